"""Local-directory backend: temp file + fsync + link (create-once) + fsync of the directory.

Every path is walked one directory at a time from the store's root with O_NOFOLLOW, and
only regular files are ever opened: a symlink planted inside the store cannot lead a
read or a write outside it, and a FIFO or device in place of a checkpoint file cannot
block or disturb discovery (it reads as UnsafeObjectError, which discovery walks past).

A full disk (ENOSPC, EDQUOT), a read-only filesystem and I/O errors become StorageError
with the store's path in the message; temp files of a failed write are always removed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from ..base.errors import AlreadyExistsError, ConfigError, PointerConflictError, StorageError
from .base import (
    HashingWriter,
    ObjectStore,
    UnsafeObjectError,
    WrittenObject,
    digest_file,
    validate_key,
)
from .file_lock import exclusive_lock
from .local_files import (
    DISK_FULL_ERRNOS,
    NEW_FILE_FLAGS,
    STORAGE_ERRNOS,
    catching,
    disk_refuses_bytes,
    is_temp_of,
    unlink_quiet,
    write_all,
)
from .local_files import temp_name as _temp_name

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# `_temp_name` is looked up in this module at each write, so a fault-injection harness can
# replace it here (benchmarks/soak_faults.py makes a writer meet a full disk that way).


class LocalStore(ObjectStore):
    native_files = True

    def __init__(self, root: str | os.PathLike):
        self.root = Path(os.path.normpath(os.path.abspath(root)))
        self.uri = self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    @staticmethod
    def _split(key: str) -> tuple[list[str], str]:
        parts = validate_key(key).split("/")
        return parts[:-1], parts[-1]

    def uri_for(self, key: str) -> str:
        return f"{self.uri}/{validate_key(key)}"

    # -- errors -------------------------------------------------------------------------
    def _os_error(self, action: str, key: str, e: OSError) -> StorageError:
        where = self.uri_for(key)
        if e.errno in DISK_FULL_ERRNOS:
            return StorageError(
                f"cannot {action} {where}: No space left on device (or quota exhausted) "
                f"under {self.root}. Free space there (remove runs you no longer need, or "
                "lower checkpoint.keep_last), or pass --store with a larger disk, then resume "
                "the run: nothing committed was lost."
            )
        if e.errno == errno.EROFS:
            return StorageError(f"cannot {action} {where}: the filesystem under {self.root} is "
                                "read-only. Remount it writable or pass --store with another "
                                "directory, then resume.")
        return StorageError(f"cannot {action} {where}: I/O error ({e.strerror}). Check the "
                            f"disk under {self.root}, then resume.")

    @contextmanager
    def _io(self, action: str, key: str) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            if e.errno in STORAGE_ERRNOS:
                raise self._os_error(action, key, e) from e
            raise

    # -- walking the tree without following links ------------------------------------------
    def _unsafe(self, rel: str, what: str) -> UnsafeObjectError:
        return UnsafeObjectError(
            f"{self.uri}/{rel} is {what}, not a regular file or directory of the store; it was "
            "not followed or opened. Remove it (and whatever planted it) from the store."
        )

    def _kind(self, name: str, dir_fd: int) -> str:
        try:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        except OSError:
            return "missing"
        if stat.S_ISLNK(mode):
            return "a symbolic link"
        if stat.S_ISDIR(mode):
            return "a directory"
        if stat.S_ISREG(mode):
            return "a regular file"
        return "a special file (FIFO, socket or device)"

    @contextmanager
    def _dir(self, parts: list[str], create: bool = False) -> Iterator[int]:
        """A descriptor of root/parts..., each step opened with O_NOFOLLOW.

        Missing directories raise FileNotFoundError (or are made, with `create`); a link
        or anything else that is not a directory raises UnsafeObjectError."""
        if create:
            os.makedirs(self.root, exist_ok=True)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, seg in enumerate(parts):
                if create:
                    try:
                        os.mkdir(seg, dir_fd=fd)
                    except FileExistsError:
                        pass
                try:
                    nfd = os.open(seg, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    kind = self._kind(seg, fd)
                    if kind == "a regular file" and not create:
                        raise FileNotFoundError(
                            errno.ENOENT, "a file where a directory was expected",
                            "/".join(parts[: i + 1])) from e
                    raise self._unsafe("/".join(parts[: i + 1]), kind) from e
                os.close(fd)
                fd = nfd
            yield fd
        finally:
            os.close(fd)

    def _open_regular(self, key: str) -> int:
        """A read-only descriptor of the regular file `key`; nothing else is opened."""
        parts, name = self._split(key)
        with self._dir(parts) as dfd:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise self._unsafe(key, self._kind(name, dfd))
            # O_NONBLOCK: should the name be swapped for a FIFO after the stat, the open
            # returns instead of waiting for a writer, and the fstat below refuses it.
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=dfd)
            fst = os.fstat(fd)
            if not stat.S_ISREG(fst.st_mode) or (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)
                raise self._unsafe(key, "replaced while being opened")
            return fd

    # -- reachability -------------------------------------------------------------------
    def check_reachable(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            if e.errno in STORAGE_ERRNOS:
                raise StorageError(f"cannot use local store {self.root}: {e.strerror}. Free "
                                   "space or fix the disk, or pass --store with another "
                                   "directory.") from e
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

    # -- creation -----------------------------------------------------------------------
    @contextmanager
    def create(self, key: str) -> Iterator[HashingWriter]:
        parts, name = self._split(key)
        with self._io("write", key), self._dir(parts, create=True) as dfd:
            if self._kind(name, dfd) != "missing":
                raise AlreadyExistsError(f"{self.uri_for(key)} already exists; refusing to overwrite")
            tmp = _temp_name(name)
            fd = os.open(tmp, NEW_FILE_FLAGS, 0o644, dir_fd=dfd)
            try:
                writer = HashingWriter(lambda data: write_all(fd, data))
                yield writer
                os.fsync(fd)
                os.close(fd)
                fd = -1
                self._link_new(tmp, name, dfd, key)
            finally:
                if fd >= 0:
                    os.close(fd)
                unlink_quiet(tmp, dfd)

    def _link_new(self, tmp: str, name: str, dfd: int, key: str) -> None:
        try:
            # link() fails if the name exists, which rename() would silently overwrite.
            os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        except FileExistsError as e:
            raise AlreadyExistsError(
                f"{self.uri_for(key)} already exists; refusing to overwrite") from e
        os.fsync(dfd)

    @contextmanager
    def create_from_path(self, key: str) -> Iterator[tuple[str, list[WrittenObject]]]:
        """`ObjectStore.create_from_path` in place: the yielded path is the temp file that
        is linked under `key` after the block, so the bytes are written once."""
        # The writer writes the temp file directly; hashing reads it back from the page cache
        # on every core while fsync runs, which beats hashing inside a Python-level writer.
        parts, name = self._split(key)
        with self._io("write", key), self._dir(parts, create=True) as dfd:
            if self._kind(name, dfd) != "missing":
                raise AlreadyExistsError(f"{self.uri_for(key)} already exists; refusing to overwrite")
            tmp = _temp_name(name)
            result: list = []
            try:
                try:
                    yield str(self.root.joinpath(*parts, tmp)), result
                except Exception as e:
                    if not isinstance(e, OSError) and disk_refuses_bytes(tmp, dfd):
                        raise self._os_error("write", key, OSError(errno.ENOSPC, "")) from e
                    raise
                fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                with os.fdopen(fd, "rb") as f:
                    synced: list[BaseException] = []
                    syncer = threading.Thread(target=catching(os.fsync, synced), args=(fd,))
                    syncer.start()
                    try:
                        size, digest, chunks = digest_file(f)
                    finally:
                        syncer.join()
                    if synced:
                        raise synced[0]
                self._link_new(tmp, name, dfd, key)
                result.append(WrittenObject(key, size, digest, chunks))
            finally:
                unlink_quiet(tmp, dfd)

    # -- reading ------------------------------------------------------------------------
    def read_bytes(self, key: str) -> bytes:
        with self.open_read(key) as f:
            return f.read()

    def open_read(self, key: str) -> BinaryIO:
        return os.fdopen(self._open_regular(key), "rb")

    def _lstat(self, key: str) -> os.stat_result | None:
        parts, name = self._split(key)
        try:
            with self._dir(parts) as dfd:
                return os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except (FileNotFoundError, UnsafeObjectError):
            return None

    def exists(self, key: str) -> bool:
        st = self._lstat(key)
        return st is not None and stat.S_ISREG(st.st_mode)

    def size(self, key: str) -> int:
        fd = self._open_regular(key)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def list(self, prefix: str) -> list[str]:
        try:
            with self._dir(validate_key(prefix).split("/")) as dfd:
                out = []
                for dirpath, _dirs, files, walk_fd in os.fwalk(".", dir_fd=dfd):
                    for name in files:
                        if name.startswith("."):  # temp files of writes in flight, locks
                            continue
                        try:
                            mode = os.stat(name, dir_fd=walk_fd, follow_symlinks=False).st_mode
                        except FileNotFoundError:
                            continue
                        if stat.S_ISREG(mode):  # links and special files are not objects
                            rel = os.path.normpath(os.path.join(prefix, dirpath, name))
                            out.append(Path(rel).as_posix())
                return sorted(out)
        except FileNotFoundError:
            return []

    def children(self, prefix: str) -> list[str]:
        try:
            with self._dir(validate_key(prefix).split("/")) as dfd:
                # Dot names are temp files of writes in flight and locks, as in list().
                return sorted(n for n in os.listdir(dfd) if not n.startswith("."))
        except FileNotFoundError:
            return []

    def delete(self, key: str) -> None:
        parts, name = self._split(key)
        with self._io("delete", key):
            try:
                with self._dir(parts) as dfd:
                    unlink_quiet(name, dfd)  # a link is removed itself, never its target
                    # A writer killed between link() and the unlink of its temp file leaves
                    # the temp behind; what is deleted is no live writer's any more.
                    for leftover in os.listdir(dfd):
                        if is_temp_of(leftover, name):
                            unlink_quiet(leftover, dfd)
            except FileNotFoundError:
                return
            for i in range(len(parts), 0, -1):
                try:
                    with self._dir(parts[: i - 1]) as pfd:
                        os.rmdir(parts[i - 1], dir_fd=pfd)
                except OSError:
                    break

    def local_path(self, key: str) -> str | None:
        st = self._lstat(key)
        return str(self._path(key)) if st is not None and stat.S_ISREG(st.st_mode) else None

    # -- pointers -----------------------------------------------------------------------
    @contextmanager
    def _locked(self, key: str) -> Iterator[tuple[int, str]]:
        parts, name = self._split(key)
        with self._dir(parts, create=True) as dfd, exclusive_lock(
                dfd, f".{name}.lock", f"{self.uri_for(key)} (its lock file .{name}.lock)"):
            yield dfd, name

    @staticmethod
    def _token(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()[:32]

    def read_versioned(self, key: str) -> tuple[bytes | None, str | None]:
        try:
            fd = self._open_regular(key)
        except FileNotFoundError:
            return None, None
        except UnsafeObjectError:
            # Something that is not a regular file sits under the name: it reads as empty
            # (unparseable) and its token lets a conditional write replace the entry itself.
            st = self._lstat(key)
            if st is None:
                raise
            return b"", f"special-{st.st_ino}-{st.st_mtime_ns}"
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        return data, self._token(data)

    def _atomic_replace(self, dfd: int, name: str, data: bytes) -> None:
        tmp = _temp_name(name)
        try:
            fd = os.open(tmp, NEW_FILE_FLAGS, 0o644, dir_fd=dfd)
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            os.fsync(dfd)
        finally:
            unlink_quiet(tmp, dfd)

    def write_if(self, key: str, data: bytes, expected_token: str | None) -> str:
        # The flock makes read-compare-replace one step for every writer on this machine.
        with self._io("write", key), self._locked(key) as (dfd, name):
            _, current = self.read_versioned(key)
            if current != expected_token:
                raise PointerConflictError(
                    f"{self.uri_for(key)} was changed by another writer "
                    f"(expected version {expected_token}, found {current})"
                )
            self._atomic_replace(dfd, name, data)
        return self._token(data)

    def write_overwrite(self, key: str, data: bytes) -> None:
        parts, name = self._split(key)
        with self._io("write", key), self._dir(parts, create=True) as dfd:
            self._atomic_replace(dfd, name, data)
