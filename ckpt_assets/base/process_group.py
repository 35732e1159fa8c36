"""One process's identity and one process group's end, for every part of the orchestrator.

A process is known by its pid and its start time (`ProcessRef`), so a pid the kernel
handed on is never taken for it; an attempt's processes are one process group, recorded
on its run (`AttemptProcesses`, tag `ckpt/processes`) and stopped the one way here
(`stop_group`: SIGTERM, the grace, SIGKILL, then wait until the group is gone). The step
that supervises its attempt (`attempt.process`), whoever finds a run whose worker is gone
(`lifecycle.state`) and the reconciler retiring a silent trainer (`lifecycle.liveness`) all
use these, with one `KILL_WAIT_S`.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import dagster as dg

from ckpt_assets.base.tags import TAG_PROCESSES
from trainer.base.outcomes import STOP_SIGNALS
from trainer.base.process_id import boot_id, stat_fields

KILL_WAIT_S = 30.0  # after SIGKILL: only a process stuck in the kernel takes longer
POLL_S = 0.1


@dataclass(frozen=True)
class ProcessRef:
    """One process ever: its pid and its start time (clock ticks after boot), so that a
    pid the kernel handed to another process since is never taken for it."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> ProcessRef | None:
        st = _stat(pid)
        return cls(pid, st[3]) if st else None

    @classmethod
    def known(cls, pid: int) -> ProcessRef:
        """A process this one started or is: its start time where /proc tells it (else
        0, and `this_machine()` is None there, so it is never judged dead)."""
        return cls.of(pid) or cls(pid, 0)

    def alive(self) -> bool:
        st = _stat(self.pid)
        return st is not None and st[0] != "Z" and st[3] == self.start


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, process group, session, start time) of a live or zombie process, read as the
    trainer reads its own (`trainer.base.process_id`): one reading of /proc for both sides."""
    fields = stat_fields(pid)
    return (fields[0], int(fields[2]), int(fields[3]), int(fields[19])) if fields else None


def this_machine() -> str | None:
    """Where pids mean the same processes: this boot of this kernel and this PID
    namespace (None where /proc cannot say)."""
    boot = boot_id()
    try:
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}" if boot else None
    except OSError:
        return None


def group_members(pgid: int, since: int = 0) -> list[int]:
    """Live (not zombie) processes of process group `pgid` that started at or after
    `since` (the group leader's start time: older ones belong to a reused number)."""
    if not os.path.isdir("/proc/self"):  # no /proc: ask the kernel whether any is left
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st and st[1] == pgid and st[0] != "Z" and st[3] >= since:
                pids.append(int(entry.name))
    return pids


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_gone(pgid: int, since: int, timeout: float, reap: subprocess.Popen | None) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if reap is not None:
            reap.poll()  # our own child turns zombie, not gone, until it is reaped
        if not group_members(pgid, since):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def stop_group(pgid: int, grace_s: float, log, since: int = 0, wait: bool = True,
               reap: subprocess.Popen | None = None) -> list[int]:
    """Stop every process of group `pgid`: SIGTERM (a trainer commits and exits 143), then
    SIGKILL after `grace_s`; return the pids that were running. `wait`: until all are gone
    (an interrupt while waiting kills them at once)."""
    left = group_members(pgid, since)
    if not left:
        return []
    log.warning(f"{len(left)} process(es) of process group {pgid} still running (pids "
                f"{', '.join(map(str, sorted(left)))}): SIGTERM"
                + (f", grace {grace_s:.0f}s" if wait else ""))
    signal_group(pgid, signal.SIGTERM)
    if not wait:
        return left
    try:
        if not wait_gone(pgid, since, grace_s, reap):
            log.warning(f"process group {pgid} still running after {grace_s:.0f}s: SIGKILL")
            signal_group(pgid, signal.SIGKILL)
            if not wait_gone(pgid, since, KILL_WAIT_S, reap):
                log.error(f"process group {pgid} survived SIGKILL for {KILL_WAIT_S:.0f}s "
                          f"(pids {group_members(pgid, since)}); they are stuck in the kernel")
    except BaseException:  # a second interrupt: nothing of the attempt may outlive it
        signal_group(pgid, signal.SIGKILL)
        raise
    return left


@dataclass(frozen=True)
class AttemptProcesses:
    """An attempt's processes, as its Dagster run records them (tag `ckpt/processes`)."""

    machine: str | None
    worker: ProcessRef  # the run worker (the process that runs the step)
    group: ProcessRef  # the training process, leader of its process group
    output: str  # the file its stdout and stderr go to
    ended: bool = False  # the step saw the group gone

    def to_tag(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def of_run(cls, run: dg.DagsterRun) -> AttemptProcesses | None:
        try:
            raw = json.loads(run.tags[TAG_PROCESSES])
            return cls(raw["machine"], ProcessRef(**raw["worker"]), ProcessRef(**raw["group"]),
                       raw["output"], bool(raw.get("ended")))
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def here(self) -> bool:
        return self.machine is not None and self.machine == this_machine()

    def worker_gone(self) -> bool:
        """Known dead: on this machine, and its process is gone (or is another one now)."""
        return self.here and not self.worker.alive()

    def left(self) -> list[int]:
        return group_members(self.group.pid, self.group.start) if self.here else []

    def stop(self, grace_s: float, log, wait: bool = True) -> list[int]:
        if not self.here:
            return []
        return stop_group(self.group.pid, grace_s, log, self.group.start, wait)


def stoppable() -> None:
    """Make the stop signals deliverable in this process with their default action. A
    blocked mask and an ignored disposition both survive exec, so a process started from a
    thread that blocks SIGTERM (as the trainer's own helper threads do) or under a shell
    that ignores SIGINT would never act on a stop it was sent before it set handlers of its
    own: a standby waiting for its handoff, or a command that sets none."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def die_with_parent() -> None:  # runs in the child between fork and exec
    stoppable()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


@dataclass
class HeldStops:
    """The stop signals that came while a process was being started, to deliver once the
    caller has it in hand."""

    signums: list[int] = field(default_factory=list)

    def deliver(self) -> None:
        """Send them again, to the handlers that were in place before (Dagster's raises the
        run's interrupt here, in the caller's own code)."""
        signums, self.signums = self.signums, []
        for signum in dict.fromkeys(signums):
            signal.raise_signal(signum)


@contextmanager
def stops_held() -> Iterator[HeldStops]:
    """Note SIGINT/SIGTERM instead of handling them while a process is started. A Popen
    with a `preexec_fn` (`die_with_parent`) runs Python's at-fork hooks in the parent, and
    a handler that raises there (Dagster's interrupt of the run) raises inside a hook, where
    the exception is printed ("Exception ignored in: _releaseLock") and lost: the run
    worker would train on, its stop forgotten. The caller delivers what was held once the
    process is recorded (`HeldStops.deliver`); signals reach Python handlers in the main
    thread only, so elsewhere nothing is held."""
    held = HeldStops()
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in before:
        signal.signal(sig, lambda signum, _frame: held.signums.append(signum))
    try:
        yield held
    except BaseException:  # nothing was started to record: what came is delivered now
        _restore(before)
        held.deliver()
        raise
    _restore(before)


def _restore(handlers: dict) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
