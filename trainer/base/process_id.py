"""One process ever, told apart from any other: the one identity of a process for the trainer
and the orchestrator alike.

A pid names a process only where it was read (this boot of this kernel, in this PID
namespace: `this_machine()`) and only until the process exits: the kernel hands the number
on. So a process is known by its machine, its pid and its start time (`ProcessId`). The
trainer's heartbeat names its writer by one; the orchestrator records an attempt's run worker
and process group by them (`ckpt_assets.base.attempt_processes`), stops exactly that process
group, never a later one that reuses the pid, and judges a run worker gone by the same
questions: is it here, and is it still running?
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

BOOT_ID = "/proc/sys/kernel/random/boot_id"
EXITED = ("Z", "X")  # /proc/<pid>/stat states of a process that has exited
STOPPED = ("T", "t")  # ... and of one that will not run until continued (SIGSTOP, a debugger)


def boot_id() -> str | None:
    """This kernel's boot: a pid means one process only within one boot of one machine."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip() or None
    except OSError:
        return None


def this_machine() -> str | None:
    """Where pids mean the same processes: this boot of this kernel and this PID namespace
    (None where /proc cannot say)."""
    boot = boot_id()
    try:
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}" if boot else None
    except OSError:
        return None


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields from the state on (the command name may hold spaces):
    [0] state, [1] parent, [2] process group, [3] session, [19] start time."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_state(pid: int) -> str | None:
    """The one-letter state of process `pid` (R, S, D, T, t, Z, ...), or None if it is gone
    or there is no /proc."""
    st = stat_fields(pid)
    return st[0] if st else None


@dataclass(frozen=True)
class ProcessId:
    """One process ever: where it ran, its pid and its start time; a process with the same
    pid on another machine, or started later, is another."""

    pid: int
    start_ticks: int | None = None  # clock ticks after boot (stat field 22); None: unknown
    machine: str | None = None  # `this_machine()` where it ran; None: unknown
    pgid: int | None = None  # its process group when it was read

    @classmethod
    def of(cls, pid: int | None = None) -> ProcessId:
        """Process `pid` (this one by default) as /proc shows it now. Where /proc cannot say
        (no such process, no /proc) only the pid is known, and it is never judged here."""
        pid = os.getpid() if pid is None else pid
        st = stat_fields(pid)
        if st is None:
            return cls(pid)
        return cls(pid, int(st[19]), this_machine(), int(st[2]))

    def here(self) -> bool:
        """Does its pid mean it here: it ran on this machine, and its start time is known?"""
        return (self.start_ticks is not None and self.machine is not None
                and self.machine == this_machine())

    def running(self) -> bool:
        """Is this very process running here (not exited, not a zombie, not a reused pid)?"""
        if not self.here():
            return False
        st = stat_fields(self.pid)
        return st is not None and st[0] not in EXITED and int(st[19]) == self.start_ticks

    def gone(self) -> bool:
        """Known to have exited: it ran here and is not running (elsewhere, nobody knows)."""
        return self.here() and not self.running()

    def group_now(self) -> int | None:
        """The process group its pid is in now (whoever has the pid), None if none has."""
        st = stat_fields(self.pid)
        return int(st[2]) if st else None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ProcessId:
        """The identity in `raw` (the keys `to_dict` writes; others are ignored). Raises
        KeyError, TypeError or ValueError for anything that is not one."""
        def opt(key: str, kind: type) -> Any:
            value = raw.get(key)
            if value is not None and not isinstance(value, kind):
                raise TypeError(f"{key}: {value!r} is not {kind.__name__}")
            return value

        return cls(int(raw["pid"]), opt("start_ticks", int), opt("machine", str),
                   opt("pgid", int))
