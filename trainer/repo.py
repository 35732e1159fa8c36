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
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from trainer.errors import CheckpointError, CheckpointNotFoundError, PointerConflictError
from trainer.storage import HashingWriter, ObjectStore, WrittenObject, validate_name
from trainer.storage.base import CHUNK_SIZE, chunk_digests, combine_chunks, file_size

log = logging.getLogger("trainer.checkpoint")

MANIFEST = "MANIFEST.json"
POINTER = "latest.json"
HEARTBEAT = "heartbeat.json"
FORMAT_VERSION = 1
POINTER_HISTORY = 16
_NAME_RE = re.compile(r"^step-(\d{9})-a(\d+)$")


def checkpoint_name(step: int, attempt: int) -> str:
    return f"step-{step:09d}-a{attempt}"


def parse_checkpoint_name(name: str) -> tuple[int, int] | None:
    m = _NAME_RE.match(name)
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

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        try:
            raw = json.loads(data)
            m = cls(**raw)
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"manifest {where} is unreadable ({e}); it is corrupt") from e
        if m.format_version != FORMAT_VERSION:
            raise CheckpointError(
                f"manifest {where} has format version {m.format_version}; this trainer reads "
                f"version {FORMAT_VERSION}. Resume with a matching trainer version."
            )
        if not isinstance(m.files, dict) or not all(
            isinstance(v, dict) and "sha256" in v and "size" in v for v in m.files.values()
        ):
            raise CheckpointError(f"manifest {where} lists files without size and sha256")
        return m

    @property
    def total_size(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())

    @property
    def sha256(self) -> str:
        """One digest for the whole checkpoint: the hash of its manifest's file list."""
        body = json.dumps(self.files, sort_keys=True).encode()
        return hashlib.sha256(body).hexdigest()


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
        """Parse and type-check latest.json; anything else raises CheckpointError."""
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict) or "generation" not in raw:
                raise ValueError("not a pointer object")
            best = raw.get("best")
            ptr = cls(
                generation=_typed(raw["generation"], int, "generation"),
                checkpoint=_typed(raw.get("checkpoint"), str, "checkpoint", optional=True),
                step=_typed(raw.get("step"), int, "step", optional=True),
                attempt=_typed(raw.get("attempt") or 0, int, "attempt"),
                history=tuple(_typed(h, str, "history[]") for h in
                              _typed(raw.get("history") or [], list, "history")),
                best=Best(_typed(best.get("checkpoint"), str, "best.checkpoint"),
                          best.get("score")) if isinstance(best, dict) else None,
                owner=raw.get("owner"),
                updated_at=raw.get("updated_at"),
            )
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(f"{where} is unreadable ({e})") from e
        return ptr


def _typed(value: Any, tp: type, what: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise TypeError(f"{what} is {value!r}, expected {tp.__name__}")
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

    def claim(self, attempt: int, parent: str | None) -> Pointer:
        """Make this attempt the run's only writer: older attempts' next commit will fail.

        `parent` is the checkpoint this attempt loaded (None when it starts fresh)."""
        self.parent = parent
        try:
            self.read_pointer()
        except CheckpointError:
            # An unreadable pointer is replaced by a claim (its token still fences).
            pass
        return self._move_pointer(attempt=attempt)

    def next_attempt(self) -> int:
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
        )
        self.store.put_new(self.key(pending.name, MANIFEST), manifest.to_json())
        old = self._pointer or Pointer()
        best = old.best
        if meta.get("is_best"):
            best = Best(pending.name, meta.get("best_score"))
        self._move_pointer(checkpoint=pending.name, step=pending.step, attempt=pending.attempt,
                           history=tuple(old.timeline[:POINTER_HISTORY]), best=best)
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
        m = Manifest.from_json(data, self.store.uri_for(key))
        if m.name != name:
            raise CheckpointError(f"manifest {self.store.uri_for(key)} names {m.name!r}, not {name!r}")
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
        Only when the pointer itself is unreadable do we fall back to every manifest.
        """
        try:
            ptr = self.read_pointer()
        except CheckpointError as e:
            log.error("CHECKPOINT FALLBACK: %s; scanning all committed checkpoints instead", e)
            return list(reversed(self.committed()))
        return ptr.timeline if ptr else []

    def find_latest_valid(self) -> tuple[Manifest | None, list[tuple[str, str]]]:
        """Newest checkpoint that verifies, and the (name, reason) of each one skipped."""
        skipped: list[tuple[str, str]] = []
        for name in self.candidates():
            try:
                m = self.verify(name)
            except (CheckpointError, CheckpointNotFoundError) as e:
                skipped.append((name, str(e)))
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
        """Delete committed checkpoints beyond the last `keep_last` (plus the best one), and
        partial ones left by older, dead attempts. Never the one the pointer names."""
        ptr = self._pointer or Pointer()
        keep = {ptr.checkpoint}
        if keep_best and ptr.best:
            keep.add(ptr.best.checkpoint)
        keep.update(ptr.timeline[: max(keep_last, 1)])
        committed = set(self.committed())
        deleted = []
        for name in self.list_names():
            if name in keep:
                continue
            parsed = parse_checkpoint_name(name)
            if name not in committed and (parsed is None or parsed[1] >= current_attempt):
                continue  # possibly a save in flight
            self._delete(name)
            deleted.append(name)
        return deleted

    def _delete(self, name: str) -> None:
        keys = self.store.list(self.key(name))
        manifest = self.key(name, MANIFEST)
        # Manifest first: from that moment the checkpoint no longer exists for readers.
        if manifest in keys:
            self.store.delete(manifest)
        for k in keys:
            if k != manifest:
                self.store.delete(k)

    # -- heartbeat ----------------------------------------------------------------------
    def heartbeat(self, payload: dict[str, Any]) -> None:
        body = json.dumps({**payload, "owner": self.owner, "time": time.time()}).encode()
        self.store.write_overwrite(f"{self.prefix}/{HEARTBEAT}", body)

    def read_heartbeat(self) -> dict[str, Any] | None:
        data, _ = self.store.read_versioned(f"{self.prefix}/{HEARTBEAT}")
        return json.loads(data) if data else None
