"""The commit protocol: checkpoints of one training run inside a store.

    <experiment>/<run>/checkpoints/step-000000120-a2/   payload file(s) + MANIFEST.json
    <experiment>/<run>/checkpoints/latest.json          pointer, moved last

A checkpoint exists once its MANIFEST.json exists (written last, create-once). It is the
run's current checkpoint once latest.json names it; latest.json only moves by a
conditional write against the version this writer last saw, so of two attempts that
share a run only one can advance it.

Where things are is `trainer.checkpoints.layout.RunLayout`; reading and verifying them is
`trainer.checkpoints.verification`, retention `trainer.checkpoints.retention`. `CheckpointRepo` is one writer of
one run: it remembers the pointer version it last saw, the attempt it claimed, and the
checkpoint its state descends from.

The protocol's steps themselves are functions of `trainer.checkpoints.commit`; this class
is their one caller that owns a claim (only the owner of the pointer commits).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, BinaryIO

from ..base.errors import (
    CheckpointError,
    PointerConflictError,
)
from ..storage import HashingWriter, ObjectStore
from . import retention, verification
from .commit import (
    CLAIM_TRIES,
    Pending,
    claimed_timeline,
    committed_pointer,
    highest_attempt,
    move_pointer,
    step_of,
    write_file,
    write_manifest,
)
from .layout import RunLayout, committed, list_names, read_heartbeat
from .manifest import (
    Manifest,
    checkpoint_name,
)
from .pointer import Pointer
from .records import Beat

log = logging.getLogger("trainer.checkpoint")

class CheckpointRepo:
    """One writer of one training run's checkpoints (and a reader of them)."""

    def __init__(self, store: ObjectStore, experiment: str, run: str):
        self.layout = RunLayout(store, experiment, run)
        self._pointer_token: str | None = None
        self._pointer: Pointer | None = None
        self.owner = uuid.uuid4().hex[:12]
        # Checkpoints this repo's discovery found corrupt, with the reason: the claim keeps
        # them out of the history that retention counts.
        self._skipped: dict[str, str] = {}
        # Names retention deleted (or found gone): dropped from the next pointer's history.
        self._retired: set[str] = set()
        # The checkpoint this attempt's state descends from: the next commit's parent. Not
        # the pointer's target, which may be a newer checkpoint that failed verification.
        self.parent: str | None = None

    # -- naming -------------------------------------------------------------------------
    @property
    def store(self) -> ObjectStore:
        return self.layout.store

    @property
    def experiment(self) -> str:
        return self.layout.experiment

    @property
    def run(self) -> str:
        return self.layout.run

    @property
    def prefix(self) -> str:
        return self.layout.prefix

    @property
    def ckpt_prefix(self) -> str:
        return self.layout.versions_prefix

    @property
    def pointer_key(self) -> str:
        return self.layout.pointer_key

    def key(self, name: str, filename: str | None = None) -> str:
        return self.layout.key(name, filename)

    def uri(self, name: str) -> str:
        return self.layout.uri(name)

    # -- pointer ------------------------------------------------------------------------
    def read_pointer(self) -> Pointer | None:
        """The pointer, or None if there is none. An unreadable pointer raises CheckpointError.

        Its version token is kept even then: the next move is conditional on it."""
        data, token = self.store.read_versioned(self.pointer_key)
        self._pointer_token = token
        self._pointer = None
        if data is None:
            return None
        self._pointer = Pointer.from_json(data, self.layout.pointer_uri)
        return self._pointer

    def _move_pointer(self, **changes: Any) -> Pointer:
        self._pointer, self._pointer_token = move_pointer(
            self.layout, self._pointer, self._pointer_token, self.owner, **changes)
        return self._pointer

    def claim(self, parent: str | None, at_least: int = 1, launched: bool = False) -> int:
        """Take the run for a new attempt and return its number; older attempts' next
        commit will fail.

        The number is claimed, not guessed: it is above the pointer's attempt, above every
        attempt in a checkpoint name, and at least `at_least` (what the orchestrator
        asked for), and it is taken by a conditional pointer write. Of two attempts that
        claim at once the loser re-reads and takes the next number, so no two attempts
        share one (nor one checkpoint name).

        `parent` is the checkpoint this attempt loaded (None when it starts fresh). The
        claim rewrites the pointer's history to the line this attempt continues: names
        that failed verification are dropped from it, and when the pointer was missing or
        unreadable the history is rebuilt from `parent`'s chain of manifests, so that
        retention can count and delete only checkpoints it knows are part of the run.

        `launched`: `at_least` is the attempt the orchestrator launched this process as; an
        attempt it has since declared failed (`fence`) is refused (PointerConflictError,
        exit 6) instead of taking the run back from the attempt that resumed it.
        """
        if parent is not None and not isinstance(parent, str):
            raise TypeError(f"claim(parent, at_least=...) takes a checkpoint name or None as "
                            f"parent, got {parent!r}; the attempt number is returned")
        self.parent = parent
        for _ in range(CLAIM_TRIES):
            try:
                old = self.read_pointer()
            except CheckpointError as e:
                # Replaced by this claim: its version token (kept by read_pointer) still
                # fences the write against another writer.
                log.error("CHECKPOINT POINTER: %s; rebuilding it from the checkpoints", e)
                old = None
            if launched and old is not None and at_least <= old.fenced_through:
                raise PointerConflictError(
                    f"attempt {at_least} of run {self.prefix} was declared failed by the "
                    f"orchestrator (the run's pointer refuses attempts up to "
                    f"{old.fenced_through}); a newer attempt resumes the run, so this process "
                    "stops without writing")
            attempt = max(at_least, (old.attempt if old else 0) + 1,
                          highest_attempt(self.layout) + 1)
            timeline, best = claimed_timeline(self.layout, old, parent, set(self._skipped))
            current = timeline[0] if timeline else None
            try:
                self._move_pointer(
                    attempt=attempt, checkpoint=current, history=tuple(timeline[1:]),
                    step=step_of(self.layout, current, old), best=best)
            except PointerConflictError:
                continue  # another attempt claimed first: read again, take a higher number
            return attempt
        raise PointerConflictError(
            f"could not claim run {self.prefix}: {CLAIM_TRIES} conditional writes of "
            f"{self.layout.pointer_uri} lost to other writers. Make sure only "
            "one attempt of this run is started at a time, then start it again."
        )

    def next_attempt(self) -> int:
        """A read-only estimate of the next attempt number; `claim` decides the real one."""
        try:
            ptr = self.read_pointer()
        except CheckpointError:
            ptr = None
        return max(ptr.attempt if ptr else 0, highest_attempt(self.layout)) + 1

    # -- writing ------------------------------------------------------------------------
    def begin(self, step: int, attempt: int, end: bool = False) -> Pending:
        return Pending(checkpoint_name(step, attempt, end), step, attempt)

    def write_file(self, pending: Pending,
                   filename: str) -> AbstractContextManager[HashingWriter]:
        """A create-once stream for `filename` of the pending checkpoint (context manager)."""
        return write_file(self.layout, pending, filename)

    @contextmanager
    def write_path(self, pending: Pending, filename: str) -> Iterator[str]:
        """Yield a file path to write `filename` of the pending checkpoint to (create-once).
        For stores with `native_files` it is written in place; others copy it."""
        key = self.key(pending.name, filename)
        with self.store.create_from_path(key) as (path, result):
            yield path
        pending.written[filename] = result[0]

    def commit(self, pending: Pending, meta: dict[str, Any]) -> Manifest:
        """Manifest last inside the checkpoint, then the pointer (conditional)."""
        manifest = write_manifest(self.layout, pending, self.parent, meta)
        self._move_pointer(**committed_pointer(self._pointer, pending, meta, self._retired))
        self.parent = pending.name
        return manifest

    # -- discovery and verification -------------------------------------------------------
    def list_names(self) -> list[str]:
        """Names of checkpoint directories (committed or not), oldest first."""
        return list_names(self.layout)

    def committed(self) -> list[str]:
        """Checkpoints that have a manifest, oldest first."""
        return committed(self.layout)

    def read_manifest(self, name: str) -> Manifest:
        return verification.read_manifest(self.layout, name)

    def verify_file(self, manifest: Manifest, filename: str, f: BinaryIO) -> None:
        """Check size and SHA-256 of an open file against the manifest (CheckpointError)."""
        verification.verify_file(self.layout, manifest, filename, f)

    def verify(self, name: str) -> Manifest:
        """Read the manifest and check every file's size and SHA-256; raise CheckpointError."""
        return verification.verify(self.layout, name)

    def candidates(self) -> list[str]:
        """Checkpoints to try, newest first (`trainer.checkpoints.verification.candidates`)."""
        return verification.candidates(self.layout, lambda _layout: self.read_pointer())

    def find_latest_valid(self) -> tuple[Manifest | None, list[tuple[str, str]]]:
        """Newest checkpoint that verifies, and the (name, reason) of each one skipped.
        The skipped ones stay out of the history this repo's next claim keeps."""
        manifest, skipped = verification.find_latest_valid(
            self.layout, lambda _layout: self.read_pointer())
        self._skipped.update(skipped)
        return manifest, skipped

    # -- retention ----------------------------------------------------------------------
    def apply_retention(self, keep_last: int, keep_best: bool, current_attempt: int) -> list[str]:
        """Delete committed checkpoints beyond the newest `keep_last` (and the best one) and
        partial ones left by older, dead attempts (`trainer.checkpoints.retention`). Never the one the
        pointer names, nor the one this attempt descends from."""
        return retention.apply_retention(
            self.layout, self._pointer or Pointer(), self.parent, keep_last, keep_best,
            current_attempt, self._retired)

    # -- heartbeat ----------------------------------------------------------------------
    def heartbeat(self, payload: dict[str, Any]) -> None:
        body = json.dumps({**payload, "owner": self.owner, "time": time.time()}).encode()
        self.store.write_overwrite(self.layout.heartbeat_key, body)

    def read_heartbeat(self) -> dict[str, Any] | None:
        return read_heartbeat(self.layout)

    def read_beat(self) -> Beat | None:
        """The heartbeat as its record (`trainer.checkpoints.records.Beat`); None if there is none or
        it is unreadable."""
        try:
            return Beat.from_dict(self.read_heartbeat())
        except ValueError:
            return None

    # -- fencing ------------------------------------------------------------------------
    def owns_run(self) -> bool:
        """Does the pointer still name this repo's claim as its owner? False once a newer
        attempt claimed the run or the orchestrator fenced it. Reads without touching the
        version this writer's next commit is conditional on. A missing pointer is not a
        takeover (the next commit finds out); an unreadable one raises CheckpointError."""
        data, _ = self.store.read_versioned(self.pointer_key)
        if data is None:
            return True
        return Pointer.from_json(data, self.store.uri_for(self.pointer_key)).owner == self.owner

    def fence(self, through_attempt: int) -> Pointer:
        """Supersede attempts up to `through_attempt` (the orchestrator declared them
        failed): the pointer is rewritten by this repo, its content kept, so an older
        attempt's next commit fails (exit 6), and their claims are refused from now on.

        Only a readable pointer is fenced: a missing one with checkpoints beside it (or an
        unreadable one) is left for the next claim to rebuild from the manifests, and
        CheckpointError says so."""
        for _ in range(CLAIM_TRIES):
            old = self.read_pointer()
            if old is None and self.committed():
                raise CheckpointError(
                    f"{self.store.uri_for(self.pointer_key)} is missing although checkpoints "
                    "exist; not fenced (the next claim rebuilds the pointer)")
            try:
                return self._move_pointer(fenced_through=max(
                    through_attempt, old.fenced_through if old else 0))
            except PointerConflictError:
                continue  # the attempt committed meanwhile: fence what it wrote, too
        raise PointerConflictError(
            f"could not fence run {self.prefix}: {CLAIM_TRIES} conditional writes of "
            f"{self.store.uri_for(self.pointer_key)} lost to other writers")
