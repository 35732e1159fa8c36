"""Stop requests: SIGTERM/SIGINT and the death of the launching process.

Handlers only set a flag; the loop saves at the next step boundary. Saving inside a
handler could interrupt a half-done optimizer step or a save already in progress.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys


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
            if sys.platform.startswith("linux"):
                # Ask the kernel for a SIGTERM when the parent dies: no training on with
                # nobody watching after the orchestrator's step process is killed.
                PR_SET_PDEATHSIG = 1
                libc = ctypes.CDLL(None, use_errno=True)
                libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != self._parent:  # parent died before prctl took effect
                self.signal_name = "PARENT_EXITED"

    def _handle(self, signum: int, _frame) -> None:
        self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        if self.signal_name is None and self._watch_parent and os.getppid() != self._parent:
            self.signal_name = "PARENT_EXITED"
        return self.signal_name is not None
