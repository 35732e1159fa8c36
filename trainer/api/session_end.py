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
    ConfigError,
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
                # Resumed from an end that no one marked final (a session lost after its
                # last step): this attempt commits it as the end.
                self._ck.last_saved_step = None
            if self._ck.last_saved_step != self.loop.step or not self._last_final:
                # The run's end, with every part (kept values too) as the script left it
                # after its post-loop work; at a step committed already, a second time.
                self._refuse_an_end_without_the_group()
                self.save("final", final=True)
        self._ck.close()
        self._stop_heartbeat()
        if not self.stopped:
            self.reporter.send(Finished(self.loop.step, dict(self.loop.metrics)))
            metrics = f": {self.loop.metrics}" if self.loop.metrics else ""
            self._say(f"training finished at step {self.loop.step}{metrics}")

    def _refuse_past_the_end(self, step: int) -> None:
        """A step past `max_steps` is a loop that counts otherwise than the session: most
        often `step()` called twice per batch, which would train half the batches it says."""
        if self.max_steps is not None and step > self.max_steps:
            raise ConfigError(
                f"step {step} is past max_steps={self.max_steps}, the run's last step: is "
                "ckpt.step() called more than once per optimizer step (twice per batch, or "
                "per micro-batch)? Call it once per optimizer step; to train longer, raise "
                "max_steps. Nothing was committed for this step")

    def _at_the_last_step(self, reasons: list[str]) -> list[str]:
        """What the step at max_steps commits. Nothing on one process: the run ends when the
        script does, so close() commits this step as the end after the post-loop work (a
        last evaluation, a test pass, the best model saved), and a kill before it resumes
        from the last trigger. Several ranks commit it as the end now, while their process
        group exists: a script destroys it after its loop, and the end is collective."""
        if self.ranks is not None:
            return [*reasons, "final"]
        self._held_best = "best" in reasons
        return []

    def _refuse_an_end_without_the_group(self) -> None:
        """Several ranks commit the end together, over their process group: once the script
        destroyed it, no rank can, and writing alone each would take itself for rank 0."""
        if self.ranks is not None and not self.ranks.alive:
            raise ConfigError(
                f"the process group was destroyed before the session ended, so the end of "
                f"run {self.experiment}/{self.run} at step {self.loop.step}, committed by "
                "all ranks together, cannot be: call ckpt.close() (or leave the `with` "
                "block) before dist.destroy_process_group(), or pass max_steps (its last "
                "step is committed as the end while the group exists). Started again, the "
                f"run resumes from its last checkpoint, at step {self._ck.last_saved_step or 0}")

    def _ends_at_this_step(self) -> bool:
        """A save now is the run's end without close(): several ranks at max_steps."""
        return (self.ranks is not None and self.max_steps is not None
                and self.loop.step >= self.max_steps)

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
