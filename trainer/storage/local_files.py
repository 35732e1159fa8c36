"""File primitives of the local store: create-once temp files, complete writes, quiet
unlinks, and the probe that tells a full disk from a writer's own failure."""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Callable

NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
STORAGE_ERRNOS = DISK_FULL_ERRNOS | {errno.EROFS, errno.EIO}
# How much a failed writer's temp file is grown to tell a full disk from other failures:
# more than any filesystem's slack at the end of a file's last block.
_PROBE_BYTES = 1 << 20


def temp_name(name: str) -> str:
    """Name of the temp file a write of `name` goes through (hidden from `list`)."""
    return f".{name}.tmp-{uuid.uuid4().hex[:12]}"


def is_temp_of(candidate: str, name: str) -> bool:
    """Is `candidate` a temp file that a write of `name` went through?"""
    return candidate.startswith(f".{name}.tmp-")


def write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        view = view[os.write(fd, view):]


def unlink_quiet(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


def disk_refuses_bytes(name: str, dir_fd: int) -> bool:
    """After a writer failed on `name`: does the filesystem refuse more bytes there?

    Native writers (torch's C++ stream) report ENOSPC as a bare iostream error, so the
    failure itself cannot be told apart from a bug. Appending to the same file (freed with
    it right after) answers the question on the same filesystem and quota."""
    try:
        fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        try:
            fd = os.open(name, NEW_FILE_FLAGS, 0o600, dir_fd=dir_fd)
        except OSError as e:
            return e.errno in DISK_FULL_ERRNOS
    except OSError:
        return False
    try:
        block = bytes(64 << 10)
        for _ in range(_PROBE_BYTES // len(block)):
            write_all(fd, block)
        os.fsync(fd)
    except OSError as e:
        return e.errno in DISK_FULL_ERRNOS
    finally:
        os.close(fd)
    return False


def catching(fn: Callable, errors: list[BaseException]) -> Callable:
    """`fn` as a thread's target that keeps its exception for the thread that joins it."""
    def run(*args):
        try:
            fn(*args)
        except BaseException as e:  # re-raised by the thread that waits for it
            errors.append(e)
    return run
