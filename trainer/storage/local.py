"""Local-directory backend: temp file + fsync + link (create-once) + fsync of the directory."""

from __future__ import annotations

import fcntl
import os
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from trainer.errors import AlreadyExistsError, ConfigError, PointerConflictError
from trainer.storage.base import (
    HashingWriter,
    ObjectStore,
    WrittenObject,
    digest_file,
    validate_key,
)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStore(ObjectStore):
    native_files = True
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).absolute()
        self.uri = self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def check_reachable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            # A local path that cannot be created will not heal by retrying: bad input.
            raise ConfigError(
                f"cannot use local store {self.root}: {e.strerror}. "
                "Pass --store with a directory you can write to."
            ) from e
        if not os.access(self.root, os.W_OK):
            raise ConfigError(
                f"local store {self.root} is not writable; pass --store with a directory "
                "you can write to."
            )

    @contextmanager
    def create(self, key: str) -> Iterator[HashingWriter]:
        final = self._path(key)
        if final.exists():
            raise AlreadyExistsError(f"{self.uri_for(key)} already exists; refusing to overwrite")
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
        f = open(tmp, "wb", buffering=0)
        try:
            writer = HashingWriter(f.write)
            yield writer
            f.flush()
            os.fsync(f.fileno())
            f.close()
            try:
                # link() fails if the name exists, which os.replace() would silently overwrite.
                os.link(tmp, final)
            except FileExistsError as e:
                raise AlreadyExistsError(
                    f"{self.uri_for(key)} already exists; refusing to overwrite"
                ) from e
            _fsync_dir(final.parent)
        finally:
            if not f.closed:
                f.close()
            tmp.unlink(missing_ok=True)

    @contextmanager
    def create_from_path(self, key: str) -> Iterator[tuple[str, list[WrittenObject]]]:
        """Like `create`, but yields (temp path, result) for a writer that wants a real file;
        after the block the file is committed under `key` and result[0] describes it."""
        # The writer writes the temp file directly; hashing reads it back from the page cache
        # on every core while fsync runs, which beats hashing inside a Python-level writer.
        final = self._path(key)
        if final.exists():
            raise AlreadyExistsError(f"{self.uri_for(key)} already exists; refusing to overwrite")
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
        result: list = []
        try:
            yield str(tmp), result
            with open(tmp, "rb") as f:
                syncer = threading.Thread(target=os.fsync, args=(f.fileno(),))
                syncer.start()
                size, digest, chunks = digest_file(f)
                syncer.join()
            try:
                os.link(tmp, final)
            except FileExistsError as e:
                raise AlreadyExistsError(
                    f"{self.uri_for(key)} already exists; refusing to overwrite") from e
            _fsync_dir(final.parent)
            result.append(WrittenObject(key, size, digest, chunks))
        finally:
            tmp.unlink(missing_ok=True)

    def read_bytes(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def open_read(self, key: str) -> BinaryIO:
        return open(self._path(key), "rb")

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix)
        if not base.is_dir():
            return []
        out = []
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if name.startswith("."):  # temp files of writes in flight
                    continue
                out.append(Path(dirpath, name).relative_to(self.root).as_posix())
        return sorted(out)

    def delete(self, key: str) -> None:
        p = self._path(key)
        p.unlink(missing_ok=True)
        parent = p.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    @contextmanager
    def _locked(self, key: str):
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.parent / f".{path.name}.lock", "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield path
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            lock.close()

    @staticmethod
    def _token(data: bytes) -> str:
        import hashlib

        return hashlib.sha256(data).hexdigest()[:32]

    def read_versioned(self, key: str) -> tuple[bytes | None, str | None]:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None, None
        return data, self._token(data)

    def _atomic_replace(self, path: Path, data: bytes) -> None:
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)

    def write_if(self, key: str, data: bytes, expected_token: str | None) -> str:
        # The flock makes read-compare-replace one step for every writer on this machine.
        with self._locked(key) as path:
            _, current = self.read_versioned(key)
            if current != expected_token:
                raise PointerConflictError(
                    f"{self.uri_for(key)} was changed by another writer "
                    f"(expected version {expected_token}, found {current})"
                )
            self._atomic_replace(path, data)
        return self._token(data)

    def write_overwrite(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._atomic_replace(path, data)

    def local_path(self, key: str) -> str | None:
        return str(self._path(key))

    def uri_for(self, key: str) -> str:
        return f"{self.uri}/{validate_key(key)}"


