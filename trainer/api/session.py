"""`CheckpointSession`: make your own training loop crash-safe and auto-resuming.

    from ckpt_trainer import CheckpointSession

    ckpt = CheckpointSession(every_steps=100, max_steps=steps)
    start = ckpt.restore(model=model, optimizer=opt, scheduler=sched, data=loader)
    for step in range(start + 1, steps + 1):
        loss = train_step(next(batches))
        ckpt.step(step, loss=loss)  # SIGTERM/SIGINT: commits this step, then exits 143

The public surface is small: `restore`, `step`, `save`, `close` (and the `with` block), the
position helpers `position`/`epochs`/`batches`, and `keep`. docs/own-loop.md is the whole
guide. This module holds what every step touches: the per-step call, its triggers and the
save. The rest delegates, one concern a module, to the same session's state:
`session_open` (which checkpoint to continue from, the claim, a finished run),
`session_end` (the end of the block, or of a script without one: exit codes, exit hooks),
`session_walk` (the epoch and batch to continue from, kept values).

When the orchestrator starts the script ($CKPT_RUN set), its run, experiment, store,
dataset and attempt take precedence over the arguments, which serve standalone runs.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from math import isfinite
from typing import Any

import numpy as np
import torch

from ..base import rng_identity
from ..base.errors import (
    ConfigError,
    DivergedError,
    PointerConflictError,
)
from ..base.interval import SaveInterval
from ..checkpoints.manifest import END_AGAIN, MAX_STEP, Manifest
from ..checkpoints.records import CheckpointRecord, Lineage
from ..checkpoints.repo import CheckpointRepo
from ..config import CheckpointConfig, parse
from ..process.contract import (
    Eval,
    LaunchEnv,
    Progress,
    Stopped,
)
from ..process.exit_hooks import (
    ends_like_the_block,
    logging_configured,
)
from ..process.liveness import Heartbeat
from ..process.report import Reporter
from ..process.signals import StopRequest
from ..ranks.distributed import Ranks
from ..ranks.rank_watch import RankBeat
from ..ranks.world import env_rank
from .checkpointer import Checkpointer
from .epochs import EpochWalk
from .kept import Kept
from .losses import SETTLE_STEPS, KeptLosses
from .parts import (
    BEST_OF_LOSS,
    BEST_OF_METRIC,
    LoopState,
    as_number,
    optimizer_warning,
    seed_all,
)
from .session_end import Ending
from .session_open import Opening
from .session_walk import Walking

log = logging.getLogger("trainer")

class CheckpointSession(Opening, Ending, Walking):
    """Checkpoints of your own loop (module docstring). `best_metric` names the metric (in
    `step(metrics=...)`) whose lowest value marks the best checkpoint, the one retention
    keeps, and commits one with `on_best`; while the metrics never contain it, best follows
    the loss: the best checkpoint is the committed one with the lowest `step(loss=...)`."""

    def __init__(self, *, run: str | None = None, experiment: str | None = None,
                 store: str | None = None, resume: str | None = None,
                 max_steps: int | None = None, best_metric: str = "loss",
                 config: dict[str, Any] | None = None, dataset: str | None = None,
                 data_version: str | None = None, code_path: str | None = None,
                 seed: int | None = None, install_signals: bool = True, **triggers: Any):
        if seed is not None:
            seed_all(seed)
        # Before restore, and after the session's own seed: what an unseeded script drew
        # from differs per attempt (`trainer.base.rng_identity`).
        self._rng_start = rng_identity.identity()
        self._rng_first: dict[str, Any] = {"attempt": None, "identity": None}
        self.launch = launched = LaunchEnv.from_env()
        self._place(launched, run, experiment, store, dataset, data_version, resume, triggers)
        self.triggers: CheckpointConfig = parse(CheckpointConfig, triggers, "checkpoint")
        self._interval = SaveInterval(self.triggers.every_seconds, self.triggers.mtbf_seconds,
                                      launched.mtbf if launched else None)
        self.max_steps = max_steps
        self.best_metric = best_metric
        self.config = config
        main = sys.modules.get("__main__")
        self.code_path = code_path or getattr(main, "__file__", None)
        self.reporter = Reporter.shared()
        self.stop = StopRequest()
        if install_signals:
            # A rank outlives its launcher only as an orphan nobody stops: it commits and
            # exits with it, as a trainer does with the orchestrator.
            self.stop.install(exit_with_parent=bool(launched and launched.exit_with_parent)
                              or env_rank()[1] > 1)
        self.loop = LoopState()
        self.stopped = False
        self.lineage: Lineage | None = None
        self.repo: CheckpointRepo | None = None
        self._ck: Checkpointer | None = None
        self._last_save_t = time.monotonic()
        self._last_beat = 0.0
        self._calm_until, self._quiet_until = 0, 0.0  # `step`'s short path: none yet
        self._losses = KeptLosses()  # the short path's losses, not read yet
        self._beat: Heartbeat | None = None
        self._rank_beat: RankBeat | None = None  # several ranks: this one's, to its launcher
        self.ranks: Ranks | None = None
        self._closed = False
        self._in_block = False  # inside `with`: leaving the block ends the session
        self._exit_hooks = False  # no block: atexit and sys.excepthook end it
        self._finishing = False
        self._prev_excepthook = None
        self._part_kinds: dict[str, str] = {}
        self._loaders: list = []  # the ResumableLoader parts (`batches()` ends their epochs)
        self._sizes: dict[str, int] = {}
        self._size_warned = False
        self._walk: EpochWalk | None = None
        self._kept: Kept | None = None  # values kept by name (`keep`)
        # The newest checkpoint of the current line: final or not, and committed by this
        # attempt or the one it resumed from (close() re-commits a resumed, unfinished end).
        self._last_final = False
        self._last_ours = False
        self._held_best = False  # the last step of max_steps was a new best: close() commits it

    # -- the per-step call -----------------------------------------------------------------
    def step(self, step: int | None = None, *, loss: float | torch.Tensor | None = None,
             metrics: dict[str, float] | None = None, epoch_end: bool = False) -> bool:
        """Record step `step` (default: the one after the last) as done; commit if a trigger
        fires; True: stop the loop now (without a `with` block: exit 143 instead). The loss
        and metrics may be tensors (detached here).

        Steps must increase, from 1 (after a resume, from the step `restore` returned plus
        one). A repeated step is an error too, not a no-op: pass a step's loss and metrics
        in one call. Nothing committed is touched by a refused step."""
        loop = self.loop
        if step is None:
            step = loop.step + 1
        # Most steps: the next one, a loss tensor or float, nothing due. Decided in a handful
        # of operations from what the last full call worked out (`_calm_until`: the first
        # step a step trigger fires; `_quiet_until`: when a time trigger or a progress report
        # is due), so the call costs about a microsecond; anything else takes the full path.
        # A tensor is kept unread: reading it would wait for the device (`trainer.api.losses`).
        if (type(step) is int and loop.step < step < self._calm_until and metrics is None
                and not epoch_end and time.monotonic() < self._quiet_until
                and not self.stop.requested and not self._beat.fenced):
            kind = type(loss)
            if kind is torch.Tensor:
                self._losses.items.append((step, loss, loss._version))
            elif kind is float and isfinite(loss):
                self._losses.items.append((step, loss, 0))
            elif loss is not None:
                return self._full_step(step, loss, metrics, epoch_end)
            self._beat.advance(step)
            loop.step = step
            return False
        return self._full_step(step, loss, metrics, epoch_end)

    @ends_like_the_block
    def _full_step(self, step: int | None, loss: float | torch.Tensor | None,
                   metrics: dict[str, float] | None, epoch_end: bool) -> bool:
        """`step` with every check and trigger; it plans the short path of the next steps."""
        step = self._checked_step(step)
        if self._beat is not None:
            self._beat.advance(step)
        self._ck.raise_if_failed()  # a background save's error fails the attempt here
        self._losses.settle(self.loop.losses, self._ck.last_saved_step)
        loss = self._checked_loss(step, loss)
        reasons = self._triggered(step, metrics, epoch_end)
        log.debug("step %d done loss %r", step, loss)
        # Read last: a stop requested while this step ran (its log line included) commits it.
        stop, fenced = self.stop.requested, self._beat is not None and self._beat.fenced
        if self.ranks is not None:
            # One decision for all ranks: a save or a stop on any rank is a save or a stop
            # on every rank, so they commit the same step.
            stop, save_due, fenced = self.ranks.agree(stop, bool(reasons), fenced)
            reasons = reasons or (["interval"] if save_due else [])
        if fenced:
            raise PointerConflictError(
                f"attempt {self.lineage.attempt} of run {self.experiment}/{self.run} was "
                "superseded (a newer attempt claimed the run, or the orchestrator declared "
                f"this one failed); it stops at step {step} without writing")
        if loss is not None:
            self.loop.losses.append(loss)
        self.loop.step = step
        if stop:
            self._say(f"{self.stop.signal_name or 'another rank'}: stop requested, "
                      f"committing a checkpoint at step {step}")
            self.save("preempted")
            self._ck.close()
            self.stopped = True
            self.reporter.send(Stopped(step, self.stop.signal_name))
            return True
        if reasons:
            self.save("best" if "best" in reasons else reasons[0])
        self._heartbeat(step)
        self._plan_calm_steps()
        return False

    def _plan_calm_steps(self) -> None:
        """Work out how long `step`'s short path holds: up to (not including) the first
        step at which a step trigger fires, and until a time trigger or the heartbeat's
        progress report is due. Zero where every step must take the full path: before
        `restore`; from a background save's start until a step took up its end (its error
        surfaces at the next step, however soon it ended); at an epoch's start or last
        batch inside `epochs()` (the walk says so: `_walk_moved`); with several
        ranks (each step is agreed); with debug logging on (a line per step; switched on
        later, it is seen at the next full step, within `heartbeat_seconds`). Anything that
        moves these (a save, `epochs()`) sets `_calm_until` to 0: the next step plans again."""
        ck, c, done = self._ck, self.triggers, self.loop.step
        walk = self._walk
        if (ck is None or ck.unsettled or self.ranks is not None or self._beat is None
                or (walk is not None and (walk.batches_due or walk.last_batch))
                or log.isEnabledFor(logging.DEBUG)):
            self._calm_until = 0
            return
        due = min(MAX_STEP + 1, done + SETTLE_STEPS)  # kept losses: read this often at least
        if c.every_steps:
            due = min(due, (done // c.every_steps + 1) * c.every_steps)
        if self.max_steps is not None:
            due = min(due, max(self.max_steps, done + 1))
        quiet = self._last_beat + c.heartbeat_seconds
        every = self._interval.every_seconds
        if every:
            quiet = min(quiet, self._last_save_t + every)
        self._calm_until, self._quiet_until = due, quiet

    def _checked_step(self, step: int | None) -> int:
        if self._ck is None:
            raise ConfigError("call restore() with your parts before the first step()")
        if self._walk is not None and self._walk.batches_due:
            raise ConfigError("step() ran inside `for epoch in ckpt.epochs(...)` without "
                              "`for batch in ckpt.batches()`: only batches() knows which "
                              "batch a resumed epoch continues with; loop over it")
        if step is None:
            step = self.loop.step + 1
        if isinstance(step, bool) or not isinstance(step, int | np.integer):
            raise ConfigError(f"step {step!r} is not an integer: pass the step number")
        if step <= self.loop.step:
            raise ConfigError(
                f"step {step} after {self.loop.step}: steps must increase, from 1. Pass each "
                "step once, with its loss and metrics in one call; after a resume, continue "
                "from the step restore() returned, plus one")
        if step > MAX_STEP:
            raise ConfigError(f"step {step} is above {MAX_STEP}, the highest step a "
                              "checkpoint name holds")
        self._refuse_past_the_end(step)
        return int(step)

    def _checked_loss(self, step: int, loss: float | torch.Tensor | None) -> float | None:
        if loss is None:
            return None
        loss = as_number(loss, "loss")
        if not math.isfinite(loss):
            raise DivergedError(
                f"loss is {loss} at step {step}; the last good checkpoint is step "
                f"{self._ck.last_saved_step}. Lower the learning rate or check the data, "
                "then start a new run.")
        return loss

    def _triggered(self, step: int, metrics: dict[str, float] | None,
                   epoch_end: bool) -> list[str]:
        c, reasons = self.triggers, []
        if metrics:
            self.loop.metrics = {k: as_number(v, f"metric {k!r}") for k, v in metrics.items()}
            self.reporter.send(Eval(step, dict(self.loop.metrics)))
            score = self.loop.metrics.get(self.best_metric, math.inf)
            if self.best_metric in self.loop.metrics and self.loop.best_of != BEST_OF_METRIC:
                # From now on the metric decides: a loss is on another scale.
                self.loop.best_of, self.loop.best_score = BEST_OF_METRIC, math.inf
            if score < self.loop.best_score:
                self.loop.best_score = score
                if c.on_best:
                    reasons.append("best")
        if c.every_steps and step % c.every_steps == 0:
            reasons.append("interval")
        if self._interval.due(time.monotonic() - self._last_save_t):
            reasons.append("time")
        if c.on_epoch_end and (epoch_end or (self._walk is not None and self._walk.last_batch)):
            reasons.append("epoch_end")
        if self.max_steps is not None and step >= self.max_steps:
            reasons = self._at_the_last_step(reasons)
        return reasons

    def _heartbeat(self, step: int) -> None:
        """Progress to the orchestrator at the heartbeat's interval (the beats themselves are
        the heartbeat thread's)."""
        now, every = time.monotonic(), self.triggers.heartbeat_seconds
        if now - self._last_beat >= every:
            self._last_beat = now
            self.reporter.send(Progress(step, self.loop.losses[-1] if self.loop.losses else None))

    def _stop_heartbeat(self, superseded: bool = False) -> None:
        if self._beat is not None:
            self._beat.stop(superseded)
        if self._rank_beat is not None:
            self._rank_beat.stop()

    @property
    def stop_requested(self) -> bool:
        """A SIGTERM/SIGINT arrived (or the orchestrator died); `step` will stop the loop."""
        return self.stop.requested

    # -- saving ---------------------------------------------------------------------------
    @ends_like_the_block
    def save(self, reason: str = "manual", *, final: bool = False) -> None:
        """Commit the parts as they are now, at the current step (once per step). `final`:
        this is the run's end (`close()` commits it; several ranks at max_steps)."""
        loop = self.loop
        # Before anything is committed: a diverged state must not be (`trainer.api.losses`).
        self._losses.settle(loop.losses, self._ck.last_saved_step)
        final = final or self._ends_at_this_step()
        is_best, self._held_best = reason == "best" or self._held_best or self._loss_is_best(), False
        # Filled by the parts as the checkpointer takes their state, before the manifest is
        # written; a new dict per save, since a background commit may still hold the last.
        self._sizes = {}
        meta = {"reason": reason, "loss": loop.losses[-1] if loop.losses else None,
                "metrics": loop.metrics, "best_score": loop.best,
                "is_best": is_best, "lineage": self.lineage.to_dict(),
                "config": self._config_ref, "part_bytes": self._sizes, "final": final,
                "max_steps": self.max_steps, "rng_identity": self._rng_record(),
                **self._interval.meta()}
        # The end at a step this attempt committed already, not as the end: a second name.
        again = final and not self._last_final and self._ck.last_saved_step == loop.step
        if self._ck.last_saved_step != loop.step or again:
            self._last_final, self._last_ours = final, True
        self._ck.save(loop.step, {**meta, END_AGAIN: True} if again else meta)
        if final and self.ranks is not None:
            # Several ranks: the final commit's collectives run on the group, so it is done
            # before step() returns (a script may destroy the process group next).
            self._ck.wait()
        self._last_save_t = time.monotonic()
        self._calm_until = 0  # the time trigger starts over: the next step plans again
        if not self._size_warned and (warning := optimizer_warning(self._part_kinds,
                                                                   self._sizes)):
            self._size_warned = True
            self.reporter.log(warning, logging.WARNING)

    def _on_commit(self, m: Manifest, stats: dict[str, Any]) -> None:
        self._interval.observe(stats)  # on the save's worker: the next interval uses it
        rec = CheckpointRecord.from_manifest(m, self.repo.uri(m.name), stats)
        loss = f", loss {rec.loss:.4g}" if isinstance(rec.loss, float) else ""
        stalled = (f"; stalled {rec.blocking_seconds:.4f}s"
                   if rec.blocking_seconds is not None else "")
        self._say(f"checkpoint committed: step {m.step}{loss} -> {rec.uri} ({rec.size} "
                  f"bytes, {rec.save_seconds:.2f}s){stalled}")
        self.reporter.send(rec)

    # -- what the session says, and how big its checkpoints are --------------------------------
    @property
    def leads(self) -> bool:
        """This process speaks for the attempt: the only rank, or rank 0 of several."""
        return self.ranks is None or self.ranks.leader

    def _say(self, msg: str) -> None:
        """One of the session's own lines: to the log and Pipes, and to stderr when the
        script configured no logging (where logging itself would drop an INFO line).
        Of several ranks, rank 0 speaks for all."""
        if not self.leads:
            log.debug(msg)
            return
        self.reporter.log(msg)
        if not logging_configured():
            print(f"trainer: {msg}", file=sys.stderr, flush=True)

    def _sizes_of_save(self, part: str, size: int) -> None:
        self._sizes[part] = size

    def _loss_is_best(self) -> bool:
        """While the metrics never named `best_metric`, is this commit at the lowest loss?"""
        loop = self.loop
        if loop.best_of == BEST_OF_METRIC or not loop.losses \
                or self._ck.last_saved_step == loop.step:
            return False
        if loop.losses[-1] < loop.best_score:
            loop.best_score, loop.best_of = loop.losses[-1], BEST_OF_LOSS
            return True
        return False
