"""The object-store interface that the commit protocol is written against.

Two backends implement it (a local directory and S3). They differ only in how they make
a write create-once and how they make a pointer update conditional; everything above
this interface (manifests, latest.json, walk-back, retention) is written once.
"""

from __future__ import annotations

import hashlib
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import BinaryIO

from trainer.errors import InvalidNameError

NAME_RULE = (
    "lowercase letters, digits, '.', '_' and '-', starting with a letter or digit, "
    "at most 64 characters"
)
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
_SEGMENT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_name(value: str, what: str = "name") -> str:
    """Experiment and run names become path segments: refuse anything that could escape."""
    if not isinstance(value, str) or not _NAME_RE.match(value) or ".." in value:
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
        if not _SEGMENT_RE.match(seg) or seg in (".", "..") or ".." in seg:
            raise InvalidNameError(
                f"invalid store key {key!r}: segment {seg!r} is not allowed; keys are "
                "'/'-separated names of letters, digits, '.', '_' and '-'"
            )
    return key


@dataclass(frozen=True)
class WrittenObject:
    key: str
    size: int
    sha256: str


class HashingWriter:
    """File-like sink that hashes what passes through on a second thread.

    hashlib releases the GIL for large buffers, so hashing one chunk overlaps with writing
    the next instead of adding a second pass over the bytes after the write.
    """

    def __init__(self, raw_write):
        self._raw_write = raw_write
        self._sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if n >= 1 << 20:
            # Join before returning: the caller may reuse its buffer once write() returns.
            t = threading.Thread(target=self._sha.update, args=(view,))
            t.start()
            self._raw_write(view)
            t.join()
        else:
            self._sha.update(view)
            self._raw_write(view)
        self.size += n
        return n

    def flush(self) -> None:  # torch's zip writer calls flush on the stream
        pass

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


class ObjectStore(ABC):
    """Create-once objects plus one kind of conditionally updated pointer object."""

    uri: str

    @abstractmethod
    @contextmanager
    def create(self, key: str) -> Iterator[HashingWriter]:
        """Yield a writer; on clean exit the object appears under `key` in one step.

        Raises AlreadyExistsError if `key` exists (committed objects are never
        overwritten). On error nothing becomes visible under `key`.
        The written size and hash are on the writer after the block.
        """

    def put_new(self, key: str, data: bytes) -> WrittenObject:
        with self.create(key) as w:
            w.write(data)
        return WrittenObject(key, w.size, w.hexdigest())

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

    def check_reachable(self) -> None:
        """Raise StorageError with advice if the store cannot be used at all."""
