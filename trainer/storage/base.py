"""The object-store interface that the commit protocol is written against.

Two backends implement it (a local directory and S3). They differ only in how they make
a write create-once and how they make a pointer update conditional; everything above
this interface (manifests, latest.json, walk-back, retention) is written once.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import re
import shutil
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO

from ..base.errors import AlreadyExistsError, CheckpointError, InvalidNameError

NAME_RULE = (
    "lowercase letters, digits, '.', '_' and '-', starting with a letter or digit, "
    "at most 64 characters"
)
_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class UnsafeObjectError(CheckpointError):
    """A link or special file where the store expects a regular file or directory.

    It is never followed or opened: a link can point out of the store, and opening a FIFO
    or device blocks or has side effects. Readers treat the object as corrupt."""


def is_segment(value: object) -> bool:
    """One safe path segment: what a checkpoint or file name inside the store may be."""
    return (isinstance(value, str) and _SEGMENT_RE.fullmatch(value) is not None
            and ".." not in value)


def validate_name(value: str, what: str = "name") -> str:
    """Experiment and run names become path segments: refuse anything that could escape."""
    # fullmatch, not match with '$': '$' also matches before a trailing newline.
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value) or ".." in value:
        raise InvalidNameError(
            f"invalid {what} {value!r}: use {NAME_RULE} (no '/', no '..'). "
            f"For example 'resnet-lr3e-4'."
        )
    return value


def validate_key(key: str) -> str:
    """A store key is '/'-joined safe segments; nothing absolute, empty, '.' or '..'."""
    if not isinstance(key, str) or not key:
        raise InvalidNameError(f"invalid store key {key!r}: it must be a non-empty string")
    for seg in key.split("/"):
        if not is_segment(seg):
            raise InvalidNameError(
                f"invalid store key {key!r}: segment {seg!r} is not allowed; keys are "
                "'/'-separated names of letters, digits, '.', '_' and '-'"
            )
    return key


CHUNK_SIZE = 64 << 20
_COPY_BLOCK = 8 << 20


@dataclass(frozen=True)
class WrittenObject:
    key: str
    size: int
    sha256: str
    chunks: tuple[str, ...] = ()  # per-chunk SHA-256 when the object spans several chunks


def combine_chunks(chunks: list[str] | tuple[str, ...]) -> str:
    """Digest of an object larger than one chunk: SHA-256 over its chunks' SHA-256 digests.

    An object of at most one chunk is digested as plain SHA-256 of its bytes. Chunking lets
    a reader verify a multi-GB file on every core at once instead of on one.
    """
    return hashlib.sha256(b"".join(bytes.fromhex(c) for c in chunks)).hexdigest()


def file_size(f: BinaryIO) -> int:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(0)
    return size


def chunk_digests(f: BinaryIO, size: int, chunk_size: int = CHUNK_SIZE) -> list[str]:
    """SHA-256 of each chunk of an open file, on all cores when it has a descriptor."""
    n = max(1, (size + chunk_size - 1) // chunk_size)
    try:
        fd = f.fileno()
    except (OSError, AttributeError, io.UnsupportedOperation):
        f.seek(0)  # in-memory file: one pass, chunk by chunk
        return [hashlib.sha256(f.read(chunk_size)).hexdigest() for _ in range(n)]

    if size == 0:
        return [hashlib.sha256().hexdigest()]
    # Hash straight from the page cache through a read-only mapping: no copy into Python.
    mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    view = memoryview(mapped)

    def one(i: int) -> str:
        return hashlib.sha256(view[i * chunk_size:(i + 1) * chunk_size]).hexdigest()

    try:
        with ThreadPoolExecutor(max_workers=min(n, os.cpu_count() or 1)) as pool:
            return list(pool.map(one, range(n)))
    finally:
        view.release()
        mapped.close()


def digest_file(f: BinaryIO) -> tuple[int, str, tuple[str, ...]]:
    """(size, digest, per-chunk digests or ()) of an open file, as HashingWriter computes them."""
    size = file_size(f)
    chunks = chunk_digests(f, size)
    if size <= CHUNK_SIZE:
        return size, chunks[0], ()
    return size, combine_chunks(chunks), tuple(chunks)


class HashingWriter:
    """File-like sink that hashes (per CHUNK_SIZE chunk) what passes through.

    hashlib releases the GIL for large buffers, so hashing a buffer runs on a second
    thread while the same buffer is written, instead of a second pass after the write.
    """

    def __init__(self, raw_write, chunk_size: int = CHUNK_SIZE):
        self._raw_write = raw_write
        self.chunk_size = chunk_size
        self._cur = hashlib.sha256()
        self._cur_n = 0
        self._done: list[str] = []
        self.size = 0

    def _hash(self, view: memoryview) -> None:
        while view.nbytes:
            take = min(view.nbytes, self.chunk_size - self._cur_n)
            self._cur.update(view[:take])
            self._cur_n += take
            view = view[take:]
            if self._cur_n == self.chunk_size:
                self._done.append(self._cur.hexdigest())
                self._cur, self._cur_n = hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n >= 1 << 20:
            # Join before returning (even when the write fails): the caller may reuse its
            # buffer once write() returns.
            t = threading.Thread(target=self._hash, args=(view,))
            t.start()
            try:
                self._raw_write(view)
            finally:
                t.join()
        else:
            self._hash(view)
            self._raw_write(view)
        self.size += n
        return n

    def flush(self) -> None:  # torch's zip writer calls flush on the stream
        pass

    @property
    def chunks(self) -> tuple[str, ...]:
        """Per-chunk digests, or () when the object fits in one chunk."""
        if self.size <= self.chunk_size:
            return ()
        tail = [self._cur.hexdigest()] if self._cur_n else []
        return tuple(self._done + tail)

    def hexdigest(self) -> str:
        if self.size <= self.chunk_size:
            return (self._done[0] if self._done else self._cur.hexdigest())
        return combine_chunks(self.chunks)

    def result(self, key: str) -> WrittenObject:
        return WrittenObject(key, self.size, self.hexdigest(), self.chunks)


class ObjectStore(ABC):
    """Create-once objects plus one kind of conditionally updated pointer object."""

    uri: str
    # True where `create_from_path` writes the object's file in place: for a local
    # directory, torch.save's native file writer beats streaming through Python. Elsewhere
    # a writer streams into `create` instead of paying for a temp copy.
    native_files: bool = False

    @abstractmethod
    @contextmanager
    def create(self, key: str) -> Iterator[HashingWriter]:
        """Yield a writer; on clean exit the object appears under `key` in one step.

        Raises AlreadyExistsError if `key` exists (committed objects are never
        overwritten). On error nothing becomes visible under `key`.
        The written size and hash are on the writer after the block.
        """

    @contextmanager
    def create_from_path(self, key: str) -> Iterator[tuple[str, list[WrittenObject]]]:
        """Like `create`, for a writer that wants a real file (torch.save to a path).

        Yields (path, result): the caller writes the object's bytes to `path`; on clean
        exit they are committed under `key` and `result[0]` describes them. The same
        create-once rules as `create` apply (AlreadyExistsError; nothing visible on error).

        This default writes a private temp file (under TMPDIR) and streams it through
        `create` after the block, so it costs a second pass over the bytes: a store whose
        objects are files (`native_files`) overrides it to write the file in place.
        """
        # Fail before the caller spends minutes producing a file for a taken name; the
        # create below is what actually guarantees create-once.
        if self.exists(key):
            raise AlreadyExistsError(f"{self.uri_for(key)} already exists; refusing to overwrite")
        result: list[WrittenObject] = []
        with tempfile.TemporaryDirectory(prefix="ckpt-object-") as tmp:
            path = os.path.join(tmp, "object")
            yield path, result
            with open(path, "rb") as f, self.create(key) as w:
                # Blocks of at least 1 MiB: HashingWriter hashes them while they are written.
                shutil.copyfileobj(f, w, _COPY_BLOCK)
        result.append(w.result(key))

    def put_new(self, key: str, data: bytes) -> WrittenObject:
        with self.create(key) as w:
            w.write(data)
        return w.result(key)

    @abstractmethod
    def read_bytes(self, key: str) -> bytes:
        """Whole object; raises FileNotFoundError if missing."""

    @abstractmethod
    def open_read(self, key: str) -> BinaryIO:
        """A seekable binary file for the object (caller closes)."""

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Keys under `prefix` + '/', recursively, as full keys, sorted."""

    def children(self, prefix: str) -> list[str]:
        """The names one level under `prefix` + '/' (objects and folders alike), sorted: a
        folder read without reading everything beneath it (the backends answer that
        natively; this is the fallback)."""
        cut = len(prefix) + 1
        return sorted({key[cut:].split("/", 1)[0] for key in self.list(prefix)})

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def read_versioned(self, key: str) -> tuple[bytes | None, str | None]:
        """Content and a version token (None, None if missing)."""

    @abstractmethod
    def write_if(self, key: str, data: bytes, expected_token: str | None) -> str:
        """Replace `key` only if its version is still `expected_token` (None: only if it
        does not exist). Returns the new token; raises PointerConflictError otherwise."""

    @abstractmethod
    def write_overwrite(self, key: str, data: bytes) -> None:
        """Unconditional small write, atomic for readers (heartbeats)."""

    @abstractmethod
    def uri_for(self, key: str) -> str: ...

    @abstractmethod
    def check_reachable(self) -> None:
        """Raise StorageError with advice if the store cannot be used at all."""

    def local_path(self, key: str) -> str | None:
        """A filesystem path for the object, where the backend has one (for mmap loads)."""
        return None
