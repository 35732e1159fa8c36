"""Starting a child process so that a stop reaches it, and no stop is lost while it starts.

Every process an attempt starts (the trainer, a command, the warm standby) starts with the
stop signals deliverable at their default action (`stoppable`), dies with the thread that
started it (`die_with_parent`), and is started under `stops_held`, so that a stop that comes
meanwhile is delivered once the caller has the process in hand.
"""

from __future__ import annotations

import ctypes
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from trainer.base.outcomes import STOP_SIGNALS


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
