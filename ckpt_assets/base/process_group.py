"""One process group's end, for every part of the orchestrator.

An attempt's processes are one process group, and it is stopped the one way here
(`stop_group`: SIGTERM, the grace, SIGKILL, then wait until the group is gone), with one
`KILL_WAIT_S`: by the step that supervises its attempt (`attempt.process`), by whoever finds
a run whose worker is gone (`base.attempt_processes`), and by the reconciler retiring a
silent trainer (`lifecycle.liveness`). Members are found in /proc as the trainer reads its
own (`trainer.base.process_id`), so a group whose number was handed on is told apart by its
leader's start time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from trainer.base.process_id import EXITED, stat_fields

KILL_WAIT_S = 30.0  # after SIGKILL: only a process stuck in the kernel takes longer
POLL_S = 0.1


def group_members(pgid: int, since: int | None = None) -> list[int]:
    """Live (not exited) processes of process group `pgid` that started at or after
    `since` (the group leader's start time: older ones belong to a reused number; None:
    not known, any member counts)."""
    if not os.path.isdir("/proc/self"):  # no /proc: ask the kernel whether any is left
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            st = stat_fields(int(entry.name))
            if (st and int(st[2]) == pgid and st[0] not in EXITED
                    and (since is None or int(st[19]) >= since)):
                pids.append(int(entry.name))
    return pids


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_gone(pgid: int, since: int | None, timeout: float, reap: subprocess.Popen | None) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if reap is not None:
            reap.poll()  # our own child turns zombie, not gone, until it is reaped
        if not group_members(pgid, since):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def stop_group(pgid: int, grace_s: float, log, since: int | None = None, wait: bool = True,
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
