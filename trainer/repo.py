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
import math
import re
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
from trainer.storage import HashingWriter, ObjectStore, WrittenObject, is_segment, validate_name
from trainer.storage.base import CHUNK_SIZE, chunk_digests, combine_chunks, file_size

log = logging.getLogger("trainer.checkpoint")

MANIFEST = "MANIFEST.json"
POINTER = "latest.json"
HEARTBEAT = "heartbeat.json"
FORMAT_VERSION = 1
# Names latest.json carries besides its current one. Retention removes deleted names from
# it, so in practice it holds about keep_last names; the bound only caps a damaged pointer.
POINTER_HISTORY = 256
CLAIM_TRIES = 20
_NAME_RE = re.compile(r"step-([0-9]{9})-a([0-9]{1,9})")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def checkpoint_name(step: int, attempt: int) -> str:
    return f"step-{step:09d}-a{attempt}"


def parse_checkpoint_name(name: str) -> tuple[int, int] | None:
    m = _NAME_RE.fullmatch(name) if isinstance(name, str) else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def file_entry(w: WrittenObject) -> dict[str, Any]:
    entry: dict[str, Any] = {"size": w.size, "sha256": w.sha256}
    if w.chunks:
        entry.update(chunk_size=CHUNK_SIZE, chunks=list(w.chunks))
    return entry


@dataclass
class Manifest:
    name: str
    step: int
    attempt: int
    files: dict[str, dict[str, Any]]
    parent: str | None
    created_at: float
    meta: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    # The run the checkpoint was written for: a copy under another run's name is refused.
    # None only in manifests written before these were recorded.
    experiment: str | None = None
    run: str | None = None

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and check a manifest; anything malformed raises CheckpointError (the
        checkpoint is then walked past like a corrupt one)."""
        try:
            raw = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"manifest {where} is unreadable ({e}); it is corrupt") from e
        if isinstance(raw, dict) and raw.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
            raise CheckpointError(
                f"manifest {where} has format version {raw.get('format_version')!r}; this "
                f"trainer reads version {FORMAT_VERSION}. Resume with a matching trainer version."
            )
        try:
            return cls._checked(raw)
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointError(
                f"manifest {where} is malformed ({e}); it is corrupt or was not written by "
                "this trainer"
            ) from e

    @classmethod
    def _checked(cls, raw: Any) -> Manifest:
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        files = _typed(raw["files"], dict, "files")
        if not files:
            raise ValueError("it lists no files")
        for filename, entry in files.items():
            if not is_segment(filename) or filename == MANIFEST:
                raise ValueError(f"file name {filename!r} is not a plain file name")
            _check_file_entry(filename, _typed(entry, dict, f"files[{filename!r}]"))
        created = _typed(raw["created_at"], (int, float), "created_at")
        if not math.isfinite(created):
            raise ValueError(f"created_at is {created!r}")
        return cls(
            name=_segment(raw["name"], "name"),
            step=_count(raw["step"], "step"),
            attempt=_count(raw["attempt"], "attempt"),
            files=files,
            parent=_segment(raw.get("parent"), "parent", optional=True),
            created_at=created,
            meta=_typed(raw.get("meta", {}), dict, "meta"),
            format_version=_typed(raw.get("format_version", FORMAT_VERSION), int,
                                  "format_version"),
            experiment=_typed(raw.get("experiment"), str, "experiment", optional=True),
            run=_typed(raw.get("run"), str, "run", optional=True),
        )

    @property
    def total_size(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())

    @property
    def sha256(self) -> str:
        """One digest for the whole checkpoint: the hash of its manifest's file list."""
        body = json.dumps(self.files, sort_keys=True).encode()
        return hashlib.sha256(body).hexdigest()


def _check_file_entry(filename: str, entry: dict[str, Any]) -> None:
    size = _count(entry["size"], f"{filename}.size")
    if not (isinstance(entry["sha256"], str) and _HEX64.fullmatch(entry["sha256"])):
        raise ValueError(f"{filename}.sha256 is {entry['sha256']!r}, not a SHA-256 hex digest")
    if "chunks" not in entry and "chunk_size" not in entry:
        return
    chunk_size = _typed(entry.get("chunk_size", CHUNK_SIZE), int, f"{filename}.chunk_size")
    if chunk_size <= 0:
        raise ValueError(f"{filename}.chunk_size is {chunk_size}; it must be positive")
    chunks = _typed(entry.get("chunks"), list, f"{filename}.chunks")
    if not all(isinstance(c, str) and _HEX64.fullmatch(c) for c in chunks):
        raise ValueError(f"{filename}.chunks holds something that is not a SHA-256 hex digest")
    want = max(1, -(-size // chunk_size))
    if len(chunks) != want:
        raise ValueError(f"{filename} lists {len(chunks)} chunk digests; {size} bytes in "
                         f"chunks of {chunk_size} make {want}")


@dataclass(frozen=True)
class Best:
    checkpoint: str
    score: float | None


@dataclass(frozen=True)
class Pointer:
    """latest.json: the run's current checkpoint and the ones before it, newest first.

    `generation` grows by one with every move; `attempt` is the attempt that owns the run
    (set by its claim, before it has committed anything)."""

    generation: int = 0
    checkpoint: str | None = None
    step: int | None = None
    attempt: int = 0
    history: tuple[str, ...] = ()
    best: Best | None = None
    owner: str | None = None
    updated_at: float | None = None

    @property
    def timeline(self) -> list[str]:
        """Checkpoints the pointer has named, newest first."""
        return [n for n in (self.checkpoint, *self.history) if n]

    def to_json(self) -> bytes:
        body = {**self.__dict__, "history": list(self.history),
                "best": self.best.__dict__ if self.best else None}
        return json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Pointer:
        """Parse and type-check latest.json; anything else raises CheckpointError.

        Every name in it must be one plain path segment: a pointer naming '../other/..'
        is damaged, and discovery scans the run's manifests instead of following it."""
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict) or "generation" not in raw:
                raise ValueError("not a pointer object")
            best = raw.get("best")
            ptr = cls(
                generation=_count(raw["generation"], "generation"),
                checkpoint=_segment(raw.get("checkpoint"), "checkpoint", optional=True),
                step=_count(raw.get("step"), "step", optional=True),
                attempt=_count(raw.get("attempt") or 0, "attempt"),
                history=tuple(_segment(h, "history[]") for h in
                              _typed(raw.get("history") or [], list, "history")),
                best=Best(_segment(best.get("checkpoint"), "best.checkpoint"),
                          _typed(best.get("score"), (int, float), "best.score", optional=True))
                if isinstance(best, dict) else None,
                owner=_typed(raw.get("owner"), str, "owner", optional=True),
                updated_at=_typed(raw.get("updated_at"), (int, float), "updated_at",
                                  optional=True),
            )
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            raise CheckpointError(f"{where} is unreadable ({e})") from e
        return ptr


def _typed(value: Any, tp: type | tuple[type, ...], what: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, tp) or isinstance(value, bool):
        names = "/".join(t.__name__ for t in (tp if isinstance(tp, tuple) else (tp,)))
        raise TypeError(f"{what} is {value!r}, expected {names}")
    return value


def _count(value: Any, what: str, optional: bool = False) -> Any:
    n = _typed(value, int, what, optional)
    if n is not None and n < 0:
        raise ValueError(f"{what} is {n}; it cannot be negative")
    return n


def _segment(value: Any, what: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not is_segment(value):
        raise ValueError(f"{what} is {value!r}, not a plain checkpoint name")
    return value


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

    def claim(self, parent: str | None, at_least: int = 1) -> int:
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
                f"checkpoint {self.uri(name)} does not exist (no {MANIFEST}); list the run's "
                f"checkpoints or use --resume auto"
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
