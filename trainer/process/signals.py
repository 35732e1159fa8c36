"""Stop requests: SIGTERM/SIGINT and the death of the launching process.

Handlers only set a flag; the loop saves at the next step boundary. Saving inside a
handler could interrupt a half-done optimizer step or a save already in progress.

When the launching process dies, whatever read the trainer's output may have died with it:
the orchestrator hands its processes files, but a stdout that is a pipe to the dead parent
would fail the next `print` (BrokenPipeError, or death by SIGPIPE) and the interpreter's
last flush (exit 120), turning a preemption into a bug. So the parent's death also points
such a pipe at /dev/null (`shield_output`), before the loop commits and exits 143.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import stat
import sys

PARENT_EXITED = "PARENT_EXITED"


class StopRequest:
    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._parent = os.getppid()
        self._watch_parent = False

    def install(self, exit_with_parent: bool = False) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)
        if exit_with_parent:
            self._watch_parent = True
            # No training on with nobody watching after the orchestrator's step process
            # is killed.
            sigterm_when_parent_dies()
            if os.getppid() != self._parent:  # parent died before prctl took effect
                self._parent_exited()

    def exiting(self) -> None:
        """The stop is committed and the process is on its way out with its status (143):
        a repeated SIGTERM is ignored from now on. The kernel sends PR_SET_PDEATHSIG's
        signal once per thread of a dying multi-threaded parent, and one that arrived
        during the interpreter's teardown, where Python puts the default action back on
        the signals it handles, would turn the exit into a death by SIGTERM. (SIGINT keeps
        its meaning: a person's second Ctrl-C.)"""
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:  # not the main thread: Python lets only that one set handlers
            pass

    def _handle(self, signum: int, _frame) -> None:
        self.signal_name = signal.Signals(signum).name
        if self.parent_gone:  # PR_SET_PDEATHSIG: the output's reader may be gone too
            shield_output()

    def _parent_exited(self) -> None:
        self.signal_name = PARENT_EXITED
        shield_output()

    @property
    def parent_gone(self) -> bool:
        """The process that launched this one died (only watched when asked to)."""
        return self._watch_parent and os.getppid() != self._parent

    @property
    def requested(self) -> bool:
        # Asked on every step: `parent_gone` inlined, the parent looked up only when watched.
        if self.signal_name is None and self._watch_parent and os.getppid() != self._parent:
            self._parent_exited()
        return self.signal_name is not None


# Loaded at import: between fork and exec (`preexec_fn`) loading a library could wait on a
# lock that another thread of the parent held when it forked.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
PR_SET_PDEATHSIG = 1


def sigterm_when_parent_dies() -> None:
    """Ask the kernel (Linux) for a SIGTERM to this process when its parent dies; one system
    call, so also safe as a `preexec_fn`."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def on_a_helper_thread() -> None:
    """Called first by every background thread of the trainer (heartbeat, background saves):
    it blocks SIGTERM and SIGINT there, so the kernel delivers a stop to the main thread.
    Seen with the heartbeat thread: with the stop signals deliverable to it, a SIGTERM from
    PR_SET_PDEATHSIG killed the trainer with the default action, before the session could
    commit and exit 143."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})


def shield_output() -> None:
    """Point stdout and stderr at /dev/null where they are pipes (or sockets) that nobody
    reads any more; anything else (a file, a terminal, a live pipe) is left as it is."""
    for fd in (1, 2):
        if _reader_gone(fd):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, fd)
            finally:
                os.close(devnull)


def _reader_gone(fd: int) -> bool:
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return False
    # The write end of a pipe whose read end is closed polls as POLLERR (a socket: HUP).
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
