"""The local store's pointer lock: an exclusive flock, waited for with a bound.

A writer holds it only to read, compare and replace one small file, so a wait longer than
`LOCK_WAIT_S` means its holder is stuck. A holder that is stopped (SIGSTOP, a debugger, a
frozen container) holds it until it is continued and is not waited for at all: the
orchestrator's fence of a frozen trainer must go on to stop that trainer, which releases
the lock, rather than wait on it forever (a blocking flock hung the reconciler that way).
"""

from __future__ import annotations

import fcntl
import os
import time

from trainer.errors import LockHeldError

# Longer than any fsync of a few hundred bytes on a busy disk; shorter than a sensor tick's
# time limit, so a fence that gives up still leaves the reconciler time to stop the holder.
LOCK_WAIT_S = 20.0
# Process states (/proc/PID/stat) in which a process runs no code until it is continued.
_STOPPED_STATES = frozenset("Tt")


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
        holder = lock_holder(fd)
        state = process_state(holder) if holder else None
        if state in _STOPPED_STATES or time.monotonic() >= deadline:
            who = f"process {holder}" if holder else "another process"
            why = "is stopped (SIGSTOP or a debugger)" if state in _STOPPED_STATES else \
                f"has held it for over {wait_s:g}s"
            raise LockHeldError(
                f"{what} is locked by {who}, which {why}; nothing was written. Continue or "
                f"end that process (kill -CONT / kill {holder or 'PID'}), then try again.")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def lock_holder(fd: int) -> int | None:
    """The pid holding a flock on the file open at `fd`, from /proc/locks (Linux), or None
    when it cannot be told."""
    st = os.fstat(fd)
    try:
        with open("/proc/locks") as f:
            lines = f.readlines()
    except OSError:
        return None
    # "1: FLOCK ADVISORY WRITE 4242 08:01:131 0 EOF" (a waiter's line has "->" after "1:").
    # The device printed is the filesystem's own, which can differ from st_dev (btrfs
    # subvolumes, overlays): the inode is matched, and the device when one line has it.
    held = {}
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[4].isdigit():
            dev, _, ino = fields[5].rpartition(":")
            if ino == str(st.st_ino):
                held[dev] = int(fields[4])
    ours = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    if ours in held:
        return held[ours]
    return next(iter(held.values())) if len(held) == 1 else None


def process_state(pid: int) -> str | None:
    """The one-letter state of process `pid` (R, S, D, T, t, Z…), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
