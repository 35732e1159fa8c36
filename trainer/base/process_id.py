"""One process on one machine, told apart from any later process that reuses its pid.

The trainer's heartbeat names its writer by one (`ProcessId`), and the orchestrator stops
exactly that process group, never a later one that reuses the pid.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str | None:
    """This kernel's boot: a pid means one process only within one boot of one machine."""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip() or None
    except OSError:
        return None


def stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields from the state on (the command name may hold spaces)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class ProcessId:
    """One process on one machine, told apart from any later process that reuses its pid."""

    host: str
    boot_id: str | None
    pid: int
    pgid: int
    start_ticks: int | None  # start time, clock ticks after boot (/proc/<pid>/stat field 22)

    @classmethod
    def of(cls, pid: int | None = None) -> ProcessId:
        pid = os.getpid() if pid is None else pid
        fields = stat_fields(pid)
        return cls(socket.gethostname(), boot_id(), pid,
                   int(fields[2]) if fields else os.getpgid(pid),
                   int(fields[19]) if fields else None)

    def on_this_machine(self) -> bool:
        """Was it started on this machine, in this boot (so its pid means it here)?"""
        return (self.host == socket.gethostname() and self.boot_id is not None
                and self.boot_id == boot_id() and self.start_ticks is not None)

    def running(self) -> bool:
        """Is this very process still running here (not a zombie, not a reused pid)?"""
        fields = stat_fields(self.pid)
        return (fields is not None and fields[0] not in ("Z", "X")
                and int(fields[19]) == self.start_ticks)

    def current_group(self) -> int | None:
        fields = stat_fields(self.pid)
        return int(fields[2]) if fields else None
