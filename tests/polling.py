"""Waiting for something to become true, on a busy machine: the one deadline loop of the
tests and benchmarks.

Never assert on timing: poll with a generous deadline, and when it passes, say what was
awaited and what was last seen, so that a timeout reads as a finding, not a mystery.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from trainer.base.process_id import EXITED, process_state

T = TypeVar("T")


class WaitTimeout(AssertionError):
    """The deadline passed before the awaited thing came true."""


def wait_for(predicate: Callable[[], T], timeout: float, interval: float = 0.1,
             what: str = "the condition", details: Callable[[], str] | None = None) -> T:
    """Call `predicate` every `interval` seconds until it returns something truthy and
    return that; after `timeout` seconds fail with `what`, the last value seen and, when
    given, `details()` (a log tail, the state of the runs).

    A predicate that raises ends the wait with its exception: that is how a caller stops
    early on a process that already died."""
    deadline = time.monotonic() + timeout
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            extra = details() if details is not None else ""
            raise WaitTimeout(f"timed out after {timeout:g}s waiting for {what}; "
                              f"last value seen: {last!r}" + (f"\n{extra}" if extra else ""))
        time.sleep(interval)


def pid_alive(pid: int) -> bool:
    """False once the process is gone or a zombie (a process that is not our child is
    reaped by its own parent, or by init)."""
    return process_state(pid) not in (None, *EXITED)
