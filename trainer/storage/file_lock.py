"""An exclusive flock, waited for with a bound: the local store's pointer lock, and the
MLflow database's creation lock (`ckpt_assets.defs.resources.creating_tables`).

A pointer writer holds it only to read, compare and replace one small file, so a wait
longer than `LOCK_WAIT_S` means its holder is stuck. A holder that is stopped (SIGSTOP, a debugger)
holds it until it is continued and is not waited for at all: the orchestrator's fence of a
frozen trainer must go on to stop that trainer, which releases the lock, rather than wait
on it forever (a blocking flock hung the reconciler that way).

A flock belongs to the open file, which a fork shares: a DataLoader worker forked while a
background commit held the lock would hold it for as long as it lives. A child closes its
copies at once (`os.register_at_fork`).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ..base.errors import LockHeldError
from ..base.process_id import STOPPED, process_state

# Longer than any fsync of a few hundred bytes on a busy disk; shorter than a sensor tick's
# time limit, so a fence that gives up still leaves the reconciler time to stop the holder.
LOCK_WAIT_S = 20.0
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC

# The lock files this process has open; the guard keeps a fork from falling between an
# open and its entry here.
_open_locks: set[int] = set()
_guard = threading.Lock()


@contextmanager
def exclusive_lock(dir_fd: int, name: str, what: str, wait_s: float | None = None
                   ) -> Iterator[None]:
    """Hold lock file `name` in directory `dir_fd` exclusively for the block (see
    `lock_exclusive`); it is released when the block ends, in a forked child at once."""
    with _guard:
        fd = os.open(name, _LOCK_FLAGS, 0o644, dir_fd=dir_fd)
        _open_locks.add(fd)
    try:
        lock_exclusive(fd, what, wait_s)
        yield
    finally:
        with _guard:
            _open_locks.discard(fd)
            os.close(fd)  # releases the flock


def _close_in_child() -> None:
    for fd in _open_locks:
        try:
            os.close(fd)
        except OSError:
            pass
    _open_locks.clear()
    _guard.release()  # held by the thread that forked, which is this child's only thread


os.register_at_fork(before=_guard.acquire, after_in_parent=_guard.release,
                    after_in_child=_close_in_child)


def lock_exclusive(fd: int, what: str, wait_s: float | None = None) -> None:
    """flock(fd, LOCK_EX) within `wait_s` seconds (LOCK_WAIT_S unless given); LockHeldError
    names the holder when it is stopped or the time is up. `what` names the locked object
    in that message."""
    wait_s = LOCK_WAIT_S if wait_s is None else wait_s
    deadline, pause = time.monotonic() + wait_s, 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        # Only a holder matched on device and inode is judged stopped: acting on another
        # filesystem's file of the same inode number would fail a healthy write.
        exact, named = lock_holders(fd)
        stopped = exact is not None and process_state(exact) in STOPPED
        if stopped or time.monotonic() >= deadline:
            holder = exact or named
            who = f"process {holder}" if holder else "another process"
            why = "is stopped (SIGSTOP or a debugger)" if stopped else \
                f"still holds it after {wait_s:g}s"
            raise LockHeldError(
                f"{what} is locked by {who}, which {why}; nothing was written. Continue or "
                f"end that process (kill -CONT / kill {holder or 'PID'}), then try again.")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def lock_holders(fd: int) -> tuple[int | None, int | None]:
    """(exact, lone): the pid holding a flock on the file open at `fd`, from /proc/locks
    (Linux), matched on device and inode; and the lone holder of a file with that inode on
    any device, since the device printed there is the filesystem's own, which can differ
    from st_dev (btrfs subvolumes, overlays). None where it cannot be told."""
    st = os.fstat(fd)
    try:
        with open("/proc/locks") as f:
            lines = f.readlines()
    except OSError:
        return None, None
    # "1: FLOCK ADVISORY WRITE 4242 08:01:131 0 EOF" (a waiter's line has "->" after "1:";
    # a holder in another pid namespace shows pid 0 or -1).
    held = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[4].isdigit() and \
                int(fields[4]) > 0:
            dev, _, ino = fields[5].rpartition(":")
            if ino == str(st.st_ino):
                held.append((dev, int(fields[4])))
    ours = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    exact = next((pid for dev, pid in held if dev == ours), None)
    pids = {pid for _, pid in held}
    return exact, exact or (pids.pop() if len(pids) == 1 else None)
