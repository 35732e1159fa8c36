"""The commit protocol: checkpoints of one training run inside a store.

    <experiment>/<run>/checkpoints/step-000000120-a2/   payload file(s) + MANIFEST.json
    <experiment>/<run>/checkpoints/latest.json          pointer, moved last

A checkpoint exists once its MANIFEST.json exists (written last, create-once). It is the
run's current checkpoint once latest.json names it; latest.json only moves by a
conditional write against the version this writer last saw, so of two attempts that
share a run only one can advance it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from trainer.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    InvalidNameError,
    PointerConflictError,
)
from trainer.liveness import Beat
from trainer.manifest import (
    MANIFEST,
    Manifest,
    checkpoint_name,
    file_entry,
    parse_checkpoint_name,
)
from trainer.pointer import Best, Pointer
from trainer.storage import HashingWriter, ObjectStore, WrittenObject, validate_name
from trainer.storage.base import CHUNK_SIZE, chunk_digests, combine_chunks, file_size

log = logging.getLogger("trainer.checkpoint")

POINTER = "latest.json"
HEARTBEAT = "heartbeat.json"
# Names latest.json carries besides its current one. Retention removes deleted names from
# it, so in practice it holds about keep_last names; the bound only caps a damaged pointer.
POINTER_HISTORY = 256
CLAIM_TRIES = 20



@dataclass
class Pending:
    """A checkpoint being written: files land under a name no one else uses."""

    name: str
    step: int
    attempt: int
    written: dict[str, WrittenObject] = field(default_factory=dict)


class CheckpointRepo:
    def __init__(self, store: ObjectStore, experiment: str, run: str):
        self.store = store
        self.experiment = validate_name(experiment, "experiment name")
        self.run = validate_name(run, "run name")
        self.prefix = f"{experiment}/{run}"
        self.ckpt_prefix = f"{self.prefix}/checkpoints"
        self.pointer_key = f"{self.ckpt_prefix}/{POINTER}"
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
    def key(self, name: str, filename: str | None = None) -> str:
        k = f"{self.ckpt_prefix}/{name}"
        return f"{k}/{filename}" if filename else k

    def uri(self, name: str) -> str:
        return self.store.uri_for(self.key(name))

    # -- pointer ------------------------------------------------------------------------
    def read_pointer(self) -> Pointer | None:
        """The pointer, or None if there is none. An unreadable pointer raises CheckpointError."""
        data, token = self.store.read_versioned(self.pointer_key)
        self._pointer_token = token
        self._pointer = None
        if data is None:
            return None
        self._pointer = Pointer.from_json(data, self.store.uri_for(self.pointer_key))
        return self._pointer

    def _move_pointer(self, **changes: Any) -> Pointer:
        old = self._pointer or Pointer()
        new = dataclasses.replace(old, **changes, generation=old.generation + 1,
                                  owner=self.owner, updated_at=time.time())
        try:
            self._pointer_token = self.store.write_if(self.pointer_key, new.to_json(),
                                                      self._pointer_token)
        except PointerConflictError as e:
            raise PointerConflictError(
                f"another attempt took over run {self.prefix} ({e}); this attempt stops "
                "writing so that two attempts never advance one run"
            ) from e
        self._pointer = new
        return new

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
            highest = max((p[1] for n in self.list_names() if (p := parse_checkpoint_name(n))),
                          default=0)
            attempt = max(at_least, (old.attempt if old else 0) + 1, highest + 1)
            timeline, best = self._claimed_timeline(old, parent)
            current = timeline[0] if timeline else None
            try:
                self._move_pointer(
                    attempt=attempt, checkpoint=current, history=tuple(timeline[1:]),
                    step=self._step_of(current, old), best=best)
            except PointerConflictError:
                continue  # another attempt claimed first: read again, take a higher number
            return attempt
        raise PointerConflictError(
            f"could not claim run {self.prefix}: {CLAIM_TRIES} conditional writes of "
            f"{self.store.uri_for(self.pointer_key)} lost to other writers. Make sure only "
            "one attempt of this run is started at a time, then start it again."
        )

    def _claimed_timeline(self, old: Pointer | None, parent: str | None
                          ) -> tuple[list[str], Best | None]:
        bad = set(self._skipped)
        if old is not None:
            timeline = [n for n in old.timeline if n not in bad]
            if parent is None:
                kept = timeline
            elif parent in timeline:
                kept = timeline[timeline.index(parent):]
            else:
                kept = self._lineage(parent)
        else:
            timeline = []
            kept = self._lineage(parent) if parent else []
        detached = [n for n in timeline if n not in kept]
        if detached:
            log.warning(
                "checkpoints %s are newer than %s, which this attempt continues from; they "
                "leave the run's history and retention keeps them. Delete them by hand once "
                "they are not needed.", ", ".join(detached), parent)
        best = old.best if old else None
        if best and (best.checkpoint in bad or best.checkpoint in detached):
            best = None
        return kept[:POINTER_HISTORY + 1], best

    def _lineage(self, name: str) -> list[str]:
        """`name` and its ancestors by the manifests' parent links, newest first, as far
        as readable manifests of this run reach."""
        chain: list[str] = []
        seen: set[str] = set()
        while name and name not in seen and len(chain) <= POINTER_HISTORY:
            seen.add(name)
            try:
                m = self.read_manifest(name)
            except (CheckpointError, CheckpointNotFoundError, InvalidNameError):
                break
            if name not in self._skipped:
                chain.append(name)
            name = m.parent
        return chain

    def _step_of(self, name: str | None, old: Pointer | None) -> int | None:
        if name is None:
            return None
        if old is not None and old.checkpoint == name:
            return old.step
        parsed = parse_checkpoint_name(name)
        if parsed:
            return parsed[0]
        try:
            return self.read_manifest(name).step
        except (CheckpointError, CheckpointNotFoundError):
            return None

    def next_attempt(self) -> int:
        """A read-only estimate of the next attempt number; `claim` decides the real one."""
        try:
            ptr = self.read_pointer()
        except CheckpointError:
            ptr = None
        attempts = [ptr.attempt] if ptr else [0]
        attempts += [p[1] for n in self.list_names() if (p := parse_checkpoint_name(n))]
        return max(attempts) + 1

    # -- writing ------------------------------------------------------------------------
    def begin(self, step: int, attempt: int) -> Pending:
        return Pending(checkpoint_name(step, attempt), step, attempt)

    @contextmanager
    def write_file(self, pending: Pending, filename: str) -> Iterator[HashingWriter]:
        key = self.key(pending.name, filename)
        with self.store.create(key) as w:
            yield w
        pending.written[filename] = w.result(key)

    @contextmanager
    def write_path(self, pending: Pending, filename: str) -> Iterator[str]:
        """Yield a file path to write `filename` of the pending checkpoint to (create-once).
        Only for stores with `native_files`; others take a stream (`write_file`)."""
        key = self.key(pending.name, filename)
        with self.store.create_from_path(key) as (path, result):
            yield path
        pending.written[filename] = result[0]

    def commit(self, pending: Pending, meta: dict[str, Any]) -> Manifest:
        """Manifest last inside the checkpoint, then the pointer (conditional)."""
        parent = self.parent
        manifest = Manifest(
            name=pending.name,
            step=pending.step,
            attempt=pending.attempt,
            files={n: file_entry(w) for n, w in pending.written.items()},
            parent=parent,
            created_at=time.time(),
            meta=meta,
            experiment=self.experiment,
            run=self.run,
        )
        self.store.put_new(self.key(pending.name, MANIFEST), manifest.to_json())
        old = self._pointer or Pointer()
        best = old.best
        if meta.get("is_best"):
            score = meta.get("best_score")
            best = Best(pending.name, score if isinstance(score, int | float) else None)
        history = [n for n in old.timeline if n not in self._retired]
        self._move_pointer(checkpoint=pending.name, step=pending.step, attempt=pending.attempt,
                           history=tuple(history[:POINTER_HISTORY]), best=best)
        self.parent = pending.name
        return manifest

    # -- discovery and verification -------------------------------------------------------
    def list_names(self) -> list[str]:
        """Names of checkpoint directories (committed or not), oldest first."""
        names = set()
        for key in self.store.list(self.ckpt_prefix):
            rest = key[len(self.ckpt_prefix) + 1:]
            if "/" in rest and parse_checkpoint_name(rest.split("/")[0]):
                names.add(rest.split("/")[0])
        return sorted(names, key=lambda n: parse_checkpoint_name(n))

    def committed(self) -> list[str]:
        """Checkpoints that have a manifest, oldest first."""
        keys = set(self.store.list(self.ckpt_prefix))
        return [n for n in self.list_names() if self.key(n, MANIFEST) in keys]

    def read_manifest(self, name: str) -> Manifest:
        key = self.key(name, MANIFEST)
        try:
            data = self.store.read_bytes(key)
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(
                f"checkpoint {self.uri(name)} does not exist (no {MANIFEST}); pass one of the "
                f"run's checkpoints, or resume from the newest that verifies (`auto`, the "
                f"default of --resume and of CheckpointSession)"
            ) from e
        where = self.store.uri_for(key)
        m = Manifest.from_json(data, where)
        if m.name != name:
            raise CheckpointError(f"manifest {where} names {m.name!r}, not {name!r}")
        parsed = parse_checkpoint_name(name)
        if parsed and parsed != (m.step, m.attempt):
            raise CheckpointError(f"manifest {where} says step {m.step}, attempt {m.attempt}; "
                                  f"its name says otherwise (it is corrupt)")
        if m.experiment is not None and (m.experiment, m.run) != (self.experiment, self.run):
            raise CheckpointError(
                f"manifest {where} belongs to run {m.experiment}/{m.run}, not "
                f"{self.experiment}/{self.run}: it was copied from another run and is not "
                "loaded. Remove it, or resume that run with its own config."
            )
        return m

    def verify_file(self, manifest: Manifest, filename: str, f: BinaryIO) -> None:
        """Check size and SHA-256 of an open file against the manifest (CheckpointError).

        Multi-chunk files are hashed chunk by chunk on all cores when the file has a
        descriptor; the error names the first chunk that does not match.
        """
        want = manifest.files[filename]
        uri = self.store.uri_for(self.key(manifest.name, filename))
        size = file_size(f)
        if size != int(want["size"]):
            raise CheckpointError(
                f"checkpoint file {uri} is {size} bytes but its manifest says {want['size']} "
                "(truncated or corrupt)"
            )
        chunks = want.get("chunks") or []
        if chunks:
            if combine_chunks(chunks) != want["sha256"]:
                raise CheckpointError(f"manifest of {uri} lists chunk digests that do not add "
                                      "up to its SHA-256 (the manifest is corrupt)")
            got = chunk_digests(f, size, int(want.get("chunk_size", CHUNK_SIZE)))
            for i, (g, w) in enumerate(zip(got, chunks, strict=True)):
                if g != w:
                    lo = i * int(want.get("chunk_size", CHUNK_SIZE))
                    raise CheckpointError(
                        f"checkpoint file {uri} does not match its manifest: chunk {i} "
                        f"(bytes {lo}..) has SHA-256 {g}, manifest says {w} (corrupt)"
                    )
            return
        sha = hashlib.sha256()
        f.seek(0)
        for block in iter(lambda: f.read(8 << 20), b""):
            sha.update(block)
        if sha.hexdigest() != want["sha256"]:
            raise CheckpointError(
                f"checkpoint file {uri} has SHA-256 {sha.hexdigest()} but its manifest says "
                f"{want['sha256']} (corrupt)"
            )

    def verify(self, name: str) -> Manifest:
        """Read the manifest and check every file's size and SHA-256; raise CheckpointError."""
        m = self.read_manifest(name)
        for filename in m.files:
            try:
                f = self.store.open_read(self.key(name, filename))
            except FileNotFoundError as e:
                raise CheckpointError(
                    f"checkpoint file {self.store.uri_for(self.key(name, filename))} listed in "
                    "its manifest is missing"
                ) from e
            with f:
                self.verify_file(m, filename, f)
        return m

    def candidates(self) -> list[str]:
        """Checkpoints to try, newest first: the pointer's, then its history.

        The pointer is authoritative: a manifest it never named (a save that lost the
        pointer race, or was cut off before step 3) is not part of the run's history.
        Only when the pointer is unreadable, or missing although manifests exist (it was
        deleted: a claim writes it before any manifest), do we fall back to scanning every
        manifest, newest attempt first.
        """
        try:
            ptr = self.read_pointer()
        except CheckpointError as e:
            log.error("CHECKPOINT FALLBACK: %s; scanning all committed checkpoints instead", e)
            return self._scan()
        if ptr is None:
            scanned = self._scan()
            if scanned:
                log.error("CHECKPOINT FALLBACK: %s is missing but %d committed checkpoint(s) "
                          "exist; scanning them", self.store.uri_for(self.pointer_key),
                          len(scanned))
            return scanned
        return ptr.timeline

    def _scan(self) -> list[str]:
        names = self.committed()
        order = [parse_checkpoint_name(n) for n in names]
        if all(order):
            # A later attempt supersedes an earlier one whatever their steps: an earlier
            # attempt's newer step can only be a save that lost the race for the pointer.
            return [n for _, n in sorted(zip(order, names, strict=True),
                                         key=lambda t: (t[0][1], t[0][0]), reverse=True)]
        return list(reversed(names))

    def find_latest_valid(self) -> tuple[Manifest | None, list[tuple[str, str]]]:
        """Newest checkpoint that verifies, and the (name, reason) of each one skipped."""
        skipped: list[tuple[str, str]] = []
        for name in self.candidates():
            try:
                m = self.verify(name)
            except (CheckpointError, CheckpointNotFoundError, InvalidNameError) as e:
                skipped.append((name, str(e)))
                self._skipped[name] = str(e)
                log.error("CHECKPOINT FALLBACK: skipping %s: %s", self.uri(name), e)
                continue
            if skipped:
                log.error(
                    "CHECKPOINT FALLBACK: resuming from %s (step %d) because %d newer "
                    "checkpoint(s) failed verification", self.uri(name), m.step, len(skipped)
                )
            return m, skipped
        return None, skipped

    # -- retention ----------------------------------------------------------------------
    def apply_retention(self, keep_last: int, keep_best: bool, current_attempt: int) -> list[str]:
        """Delete the run's committed checkpoints beyond the newest `keep_last` (and the best
        one), and partial ones left by older, dead attempts.

        Only checkpoints in the pointer's history are counted and deleted: the claim keeps
        that history to the line this attempt continues, without names that failed
        verification. A committed checkpoint the history does not name (detached by a
        walk-back or an explicit resume, or a save that lost the pointer race) is left in
        place: retention never deletes what it has not accounted for. Never the one the
        pointer names, nor the one this attempt descends from."""
        ptr = self._pointer or Pointer()
        committed = set(self.committed())
        good = [n for n in ptr.timeline if n in committed]
        self._retired.update(n for n in ptr.timeline if n not in committed)
        keep = {ptr.checkpoint, self.parent, *good[: max(keep_last, 1)]}
        if keep_best and ptr.best:
            keep.add(ptr.best.checkpoint)
        deleted = []
        for name in good:
            if name not in keep:
                self._delete(name)
                self._retired.add(name)
                deleted.append(name)
        accounted = set(ptr.timeline)
        for name in self.list_names():
            if name in committed or name in accounted:
                continue
            parsed = parse_checkpoint_name(name)
            if parsed is None or parsed[1] >= current_attempt:
                continue  # possibly a save in flight
            if self._delete(name, only_partial=True):
                deleted.append(name)
        return deleted

    def _delete(self, name: str, only_partial: bool = False) -> bool:
        keys = self.store.list(self.key(name))
        manifest = self.key(name, MANIFEST)
        if only_partial and manifest in keys:
            return False  # committed since it was listed: not a partial any more
        # Manifest first: from that moment the checkpoint no longer exists for readers.
        if manifest in keys:
            self.store.delete(manifest)
        for k in keys:
            if k != manifest:
                self.store.delete(k)
        return True

    # -- heartbeat ----------------------------------------------------------------------
    def heartbeat(self, payload: dict[str, Any]) -> None:
        body = json.dumps({**payload, "owner": self.owner, "time": time.time()}).encode()
        self.store.write_overwrite(f"{self.prefix}/{HEARTBEAT}", body)

    def read_heartbeat(self) -> dict[str, Any] | None:
        data, _ = self.store.read_versioned(f"{self.prefix}/{HEARTBEAT}")
        return json.loads(data) if data else None

    def read_beat(self) -> Beat | None:
        """The heartbeat as its record (`trainer.liveness.Beat`); None if there is none or
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
