"""The end of a `CheckpointSession`: leaving the `with` block, or a script without one
ending as the block would (exit hooks), and the exit code each outcome has.

One concern of the session's (`trainer.api.session`), on the session's own state: a mixin
of `CheckpointSession`, never used on its own.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import Self

from ..base.errors import (
    NothingCommittedError,
    PointerConflictError,
)
from ..base.outcomes import Outcome
from ..process.contract import (
    Finished,
)
from ..process.exit_hooks import (
    at_interpreter_exit,
    ends_like_the_block,
    exit_now,
)
from ..process.report import report_failure
from ..process.signals import shield_output

log = logging.getLogger("trainer")


class Ending:
    """How a session ends: `close`, the `with` block, and its no-block twin."""

    @ends_like_the_block

    def close(self) -> None:
        """Commit the last step if no trigger did, wait for background saves, report the
        end. Called by the `with` block on success; call it yourself without one."""
        if self._closed or self._ck is None:
            return
        self._closed = True
        if not self.stopped and self.loop.step == 0 and self._ck.last_saved_step is None:
            raise NothingCommittedError(
                f"the script ended without training a step, so run {self.experiment}/"
                f"{self.run} has no checkpoint: call ckpt.step(...) after each training step "
                "(did the training loop run at all? an empty data set or range ends it "
                "at once)")
        if not self.stopped and self.loop.step > 0:
            if self._ck.last_saved_step == self.loop.step and not (
                    self._last_final or self._last_ours):
                # Resumed from an end that no one marked final (a run without max_steps
                # whose last session was lost): this attempt commits it as the end.
                self._ck.last_saved_step = None
            if self._ck.last_saved_step != self.loop.step:
                self.save("final", final=True)
        self._ck.close()
        self._stop_heartbeat()
        if not self.stopped:
            self.reporter.send(Finished(self.loop.step, dict(self.loop.metrics)))
            metrics = f": {self.loop.metrics}" if self.loop.metrics else ""
            self._say(f"training finished at step {self.loop.step}{metrics}")

    def __enter__(self) -> Self:
        self._in_block = True
        self._drop_exit_hooks()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, Exception):
            return False  # SystemExit, KeyboardInterrupt: not ours to translate
        code = self._finish(exc)
        if code:
            raise SystemExit(code)
        return False

    def _finish(self, exc: BaseException | None) -> int:
        """End the session as leaving the block does: close it, or after an error wait for
        background saves and report the error once; the exit code."""
        self._finishing = True
        code = 0
        try:
            if exc is None:
                self.close()
                code = (Outcome.PREEMPTED if self.stopped else Outcome.SUCCESS).exit_code
        except Exception as e:  # a failed final commit is the attempt's failure
            exc = e
        if isinstance(exc, BrokenPipeError) and self.stop.parent_gone:
            exc, code = None, self._output_lost()
        if exc is not None:
            if self._ck is not None:
                try:
                    self._ck.close()
                except Exception:  # the original error is the one to report
                    log.exception("background save failed while stopping")
            code = report_failure(exc, self.reporter)
        self._stop_heartbeat(superseded=isinstance(exc, PointerConflictError))
        self.reporter.close()
        self._drop_exit_hooks()
        if self.ranks is not None and code == Outcome.RANK_LOST.exit_code:
            exit_now(code)  # past the broken group's destructors (`trainer.ranks.distributed`)
        if code == Outcome.PREEMPTED.exit_code:
            self.stop.exiting()
        return code

    def _install_exit_hooks(self) -> None:
        if self._exit_hooks:
            return
        self._exit_hooks = True
        self._hooks_pid = os.getpid()
        at_interpreter_exit(self._at_exit)
        self._prev_excepthook, sys.excepthook = sys.excepthook, self._excepthook

    def _drop_exit_hooks(self) -> None:
        if not self._exit_hooks:
            return
        self._exit_hooks = False
        atexit.unregister(self._at_exit)  # (threading's exit callbacks cannot be withdrawn:
        # `_at_exit` does nothing once the session finished)
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook

    def _at_exit(self) -> None:
        """The script ended normally: close the session as the end of the block would.
        Not in a forked child (a DataLoader worker): it inherits the callback, and
        multiprocessing runs threading's exit callbacks when the child ends, where closing
        would commit, or fail for want of a step, from a copy of the script."""
        if self._finishing or os.getpid() != self._hooks_pid:
            return
        code = self._finish(None)
        if code:  # the final commit failed; an atexit callback cannot set the status otherwise
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _excepthook(self, exc_type, exc, tb) -> None:
        if self._finishing or self._closed or not isinstance(exc, Exception):
            # Not the training's failure to report (KeyboardInterrupt, or after close()); and
            # no final commit of a half-done step at exit either.
            self._finishing = True
            prev = self._prev_excepthook
            self._drop_exit_hooks()
            return prev(exc_type, exc, tb)
        raise SystemExit(self._finish(exc))  # the traceback is logged once, by the report

    def _output_lost(self) -> int:
        """The script wrote to a pipe whose reader died with the launching process: that is
        a preemption, not a bug. Its state may be mid-step, so nothing more is committed."""
        shield_output()
        step = None
        if self._ck is not None:
            try:
                self._ck.close()
                step = self._ck.last_saved_step
            except Exception:  # a background save that failed is lost like the step
                log.exception("background save failed while stopping")
        self.reporter.log("the launching process died, and the script's output with it: "
                          f"stopped; the last committed step is {step}", logging.WARNING)
        return Outcome.PREEMPTED.exit_code
