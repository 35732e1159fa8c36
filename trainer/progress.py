"""A progress line on a terminal; plain log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("trainer")


class Progress:
    def __init__(self, total: int, start: int, log_every_s: float = 5.0):
        self.total = total
        self.start_step = start
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.log_every_s = log_every_s
        self._last = 0.0

    def update(self, step: int, loss: float, lr: float) -> None:
        now = time.monotonic()
        done = step - self.start_step
        rate = done / max(now - self.t0, 1e-9)
        eta = (self.total - step) / rate if rate > 0 else float("inf")
        line = (f"step {step}/{self.total} loss {loss:.4f} lr {lr:.2e} "
                f"{rate:.1f} steps/s ETA {eta:.0f}s")
        if self.tty:
            sys.stderr.write("\r" + line + " " * 8)
            sys.stderr.flush()
            if step == self.total:
                sys.stderr.write("\n")
        elif now - self._last >= self.log_every_s or step == self.total:
            self._last = now
            log.info(line)
