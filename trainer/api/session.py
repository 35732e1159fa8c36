"""`CheckpointSession`: make your own training loop crash-safe and auto-resuming.

    from .. import CheckpointSession

    ckpt = CheckpointSession(every_steps=100, max_steps=steps)
    start = ckpt.restore(model=model, optimizer=opt, scheduler=sched, data=loader)
    for step in range(start + 1, steps + 1):
        loss = train_step(next(batches))
        ckpt.step(step, loss=loss)  # SIGTERM/SIGINT: commits this step, then exits 143

or, with the exit handled where you can see it:

    with CheckpointSession(every_steps=100, max_steps=steps) as ckpt:
        start = ckpt.restore(model=model, optimizer=opt, scheduler=sched, data=loader)
        for step in range(start + 1, steps + 1):
            loss = train_step(next(batches))
            if ckpt.step(step, loss=loss):
                break  # SIGTERM/SIGINT: a checkpoint of this step is committed

Parts are anything with `state_dict()`/`load_state_dict()` (modules, optimizers,
schedulers, a `GradScaler`, `trainer.ResumableLoader`) or a plain `dict` of values, which is
restored in place. The session adds the RNG states (Python, NumPy, torch, CUDA) and its
own counters, so a resumed run continues bit for bit.

`restore` finds the checkpoint to continue from (the newest that verifies, or the one named
by `resume=`, $CKPT_RESUME_FROM or $CHECKPOINT_PATH), claims the run so an older attempt
can no longer commit, loads every part and returns the step to continue after (0 when
starting fresh). `step` applies the triggers (every N steps or seconds, epoch end, a new
best, the final step), commits through the store's protocol, reports to Dagster Pipes when
the orchestrator started the script, and returns True once a stop was requested. Leaving
the `with` block turns the outcome into the documented exit code: 143 after a stop, 2 bad
input, 3 unloadable checkpoint, 4 divergence, 5 store unavailable, 6 superseded, 1 a bug,
8 no step trained (no checkpoint). A run whose checkpoint to continue from is final is
done: `restore` says "already finished at step N" and ends the process with 0, unless
`continue_finished=True`.
Without a block the session does the same by itself: an error of its own ends the process
with its code, `step` exits 143 once a stop's checkpoint is committed, an uncaught
exception is reported through `sys.excepthook` (exit 1), and leaving the script normally
closes the session at interpreter exit (the last step committed, exit 0).

A loop without a DataLoader gets its position from the session: `position(n)` is the epoch
and batch to continue from for `n` batches per epoch, and `epochs()`/`batches()` iterate
them, re-running an epoch's end-of-epoch work when a resume lands right after its last
batch. The session's own lines (resumed from, committed, stop) reach stderr when the script
configured no logging.

When the orchestrator starts the script ($CKPT_RUN set), its run, experiment, store,
dataset and attempt take precedence over the arguments, which serve standalone runs.

Why this module is long: `CheckpointSession` is the whole public API of the own loop
(restore, step, save, close, the block and its no-block twin, the position helpers), and
one class a user reads in one place beats a class spread over modules; what does not need
its state lives beside it (`parts.py`, `epochs.py`, `exit_hooks.py`, `resume.py`).
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Iterator
from math import isfinite
from typing import Any

import numpy as np
import torch

from ..base import rng_identity, strict_json
from ..base.errors import (
    AlreadyExistsError,
    ConfigError,
    DivergedError,
    NothingCommittedError,
    PointerConflictError,
)
from ..base.interval import SaveInterval
from ..base.outcomes import Outcome
from ..checkpoints.dataset import check_same_data, dataset_manifest
from ..checkpoints.manifest import MAX_STEP, Manifest
from ..checkpoints.records import CheckpointRecord, Lineage
from ..checkpoints.repo import CheckpointRepo
from ..checkpoints.resume import resolve_resume
from ..config import CheckpointConfig, parse
from ..process.code_version import ckpt_assets_version, code_version_of
from ..process.contract import (
    RESUME_FROM_ALIAS,
    Env,
    Eval,
    Finished,
    LaunchEnv,
    Progress,
    Skipped,
    Started,
    Stopped,
)
from ..process.exit_hooks import (
    at_interpreter_exit,
    ends_like_the_block,
    exit_now,
    logging_configured,
)
from ..process.liveness import Heartbeat
from ..process.report import Reporter, report_failure
from ..process.signals import StopRequest, shield_output
from ..ranks.distributed import Ranks
from ..ranks.rank_watch import RankBeat
from ..ranks.sharded import ShardedParts
from ..ranks.world import env_rank
from ..storage import open_store
from .checkpointer import Checkpointer, RNGState
from .epochs import EpochWalk, Position, position_of, walk_batches, walk_epochs
from .kept import KEPT_PART, Kept
from .parts import (
    BEST_OF_LOSS,
    BEST_OF_METRIC,
    OPTIMIZER_SIZE_WARNING,
    LoopState,
    Measured,
    as_number,
    as_part,
    human_bytes,
    kind_of,
    seed_all,
)

log = logging.getLogger("trainer")

class CheckpointSession:
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
        self._beat: Heartbeat | None = None
        self._rank_beat: RankBeat | None = None  # several ranks: this one's, to its launcher
        self.ranks: Ranks | None = None
        self._closed = False
        self._in_block = False  # inside `with`: leaving the block ends the session
        self._exit_hooks = False  # no block: atexit and sys.excepthook end it
        self._finishing = False
        self._prev_excepthook = None
        self._part_kinds: dict[str, str] = {}
        self._sizes: dict[str, int] = {}
        self._size_warned = False
        self._walk: EpochWalk | None = None
        self._kept: Kept | None = None  # values kept by name (`keep`)
        # The newest checkpoint of the current line: final or not, and committed by this
        # attempt or the one it resumed from (close() re-commits a resumed, unfinished end).
        self._last_final = False
        self._last_ours = False

    def _place(self, launched: LaunchEnv | None, run, experiment, store, dataset, data_version,
               resume, triggers: dict[str, Any]) -> None:
        """Which run this session writes, where, from what. Launched by the orchestrator,
        its run, experiment, store, dataset and attempt win over the arguments (which serve
        standalone runs), so a script cannot write into another run than its own."""
        if launched is not None:
            self.run, self.experiment = launched.run, launched.experiment
            self.store_uri = launched.store_uri or store or os.path.abspath("checkpoints")
            self.dataset = launched.dataset_uri or dataset
            self._data_version = launched.data_version or data_version
            if launched.heartbeat_seconds is not None:
                # The orchestrator judges liveness by heartbeats: its interval holds.
                triggers["heartbeat_seconds"] = launched.heartbeat_seconds
            self.resume = resume or launched.resume_from or "auto"
            return
        self.run, self.experiment = run or "run", experiment or "default"
        self.store_uri = store or os.environ.get(Env.STORE_URI) or os.path.abspath("checkpoints")
        self.dataset, self._data_version = dataset, data_version
        self.resume = (resume or os.environ.get(Env.RESUME_FROM)
                       or os.environ.get(RESUME_FROM_ALIAS) or "auto")

    # -- resume -------------------------------------------------------------------------
    @ends_like_the_block
    def restore(self, parts: dict[str, Any] | None = None, /, **named: Any) -> int:
        """Register the named parts, load the checkpoint to continue from (if any), and
        return the step it holds (0: start fresh)."""
        if not self._in_block:
            self._install_exit_hooks()
        if self._ck is not None:
            raise ConfigError("restore() was called twice; call it once, after every part exists")
        drawn = rng_identity.torch_drawn()  # before the checkpoint's generators are set
        all_parts = {**(parts or {}), **named}
        sharded, wrapped = self._wrap_parts(all_parts)
        self.ranks = self._join_ranks()
        store = open_store(self.store_uri)
        store.check_reachable()
        self.repo = CheckpointRepo(store, self.experiment, self.run)
        data_version = self.data_version
        manifest, skipped, attempt = self._resume_point(data_version)
        if self._done(manifest):
            self._already_finished(manifest)
        ck = self._ck = Checkpointer(self.repo, wrapped, attempt, self.triggers.keep_last,
                                     self.triggers.keep_best, self.triggers.async_save,
                                     self.ranks, sharded)
        ck.on_commit = self._on_commit
        if manifest is not None:
            t0 = time.perf_counter()
            ck.load(manifest)
            ck.last_saved_step = manifest.step
            self._last_final = manifest.meta.get("final") is True
            self._say(f"resumed from {self.repo.uri(manifest.name)} at step {manifest.step} "
                      f"(restore {time.perf_counter() - t0:.2f}s)")
        else:
            self._say(f"starting {self.experiment}/{self.run} from scratch (attempt {attempt})")
        self._compare_generators(manifest, attempt, drawn)
        self.lineage = self._lineage(attempt, manifest, data_version)
        self._config_ref = self._store_config()
        self.reporter.send(Started(
            attempt, self.lineage.resumed_from_step,
            self.repo.uri(manifest.name) if manifest else None,
            [Skipped(n, r) for n, r in skipped], self.max_steps, self.lineage.to_dict()))
        self._last_save_t = time.monotonic()
        self._plan_calm_steps()
        return self.loop.step

    def _wrap_parts(self, all_parts: dict[str, Any]) -> tuple[ShardedParts | None, dict]:
        """(the fully_shard-ed parts, which go through DCP (`trainer.ranks.sharded`); every other
        part, with the loop, the generators and the kept values, each wrapped to measure its
        state as the checkpointer takes it: the record's part_bytes)."""
        sharded, unsharded = ShardedParts.split(all_parts)
        wrapped = {name: as_part(name, obj) for name, obj in unsharded.items()}
        wrapped.update(loop=self.loop, rng=RNGState())
        if self._kept is not None:
            if KEPT_PART in all_parts:
                raise ConfigError(f"checkpoint part name {KEPT_PART!r} holds the values of "
                                  "keep(); rename your part")
            wrapped[KEPT_PART] = self._kept
        self._part_kinds = {name: kind_of(obj) for name, obj in all_parts.items()}
        return sharded, {name: Measured(part, name, self._sizes_of_save)
                         for name, part in wrapped.items()}

    def _join_ranks(self) -> Ranks | None:
        """This process's place among several ranks (None: alone), its liveness beating."""
        rank, world = env_rank()
        if world > 1 and self._rank_beat is None:
            # Every rank's liveness reaches its launcher, from before the first collective.
            self._rank_beat = RankBeat(rank)
            self._rank_beat.start()
        return Ranks.detect(self.triggers.collective_timeout_s, self.triggers.async_save)

    def _resume_point(self, data_version: str | None
                      ) -> tuple[Manifest | None, list[tuple[str, str]], int]:
        """The checkpoint to continue from, the ones skipped, and this attempt's number.
        One process decides (rank 0 of several): it beats, verifies and claims the run;
        the other ranks learn its decision and read the same manifest."""
        repo = self.repo
        if self.ranks is not None and not self.ranks.leader:
            name, skipped, attempt = self.ranks.from_leader(None)
            return (repo.read_manifest(name) if name else None), skipped, attempt
        # Beats from here on, whatever the restore and each step cost: liveness is not
        # progress (trainer.process.liveness).
        self._beat = Heartbeat(repo, self.triggers.heartbeat_seconds,
                               self.launch.dagster_run_id if self.launch else None)
        self._beat.start()
        manifest, skipped = resolve_resume(repo, self.resume)
        if self._done(manifest):  # a finished run is read, never claimed (`restore`)
            if self.ranks is not None:
                self.ranks.from_leader((manifest.name, skipped, manifest.attempt))
            return manifest, skipped, manifest.attempt
        if manifest is not None:
            lineage = Lineage.from_dict(manifest.meta.get("lineage"))
            check_same_data(lineage.data_version, data_version, repo.uri(manifest.name))
        attempt = repo.claim(manifest.name if manifest else None,
                             at_least=self.launch.attempt if self.launch else 1,
                             launched=self.launch is not None)
        self._beat.claimed(attempt, manifest.step if manifest else 0)
        if self.ranks is not None:
            self.ranks.from_leader((manifest.name if manifest else None, skipped, attempt))
        return manifest, skipped, attempt

    def _lineage(self, attempt: int, resumed: Manifest | None,
                 data_version: str | None) -> Lineage:
        return Lineage(
            experiment=self.experiment, run=self.run, attempt=attempt,
            dagster_run_id=self.launch.dagster_run_id if self.launch else None,
            root_run_id=self.launch.root_run_id if self.launch else None,
            resumed_from_step=resumed.step if resumed else None,
            code_version=ckpt_assets_version(),
            user_code_version=code_version_of(self.code_path) if self.code_path else None,
            data_version=data_version, dataset=self.dataset)

    @property
    def data_version(self) -> str | None:
        """The dataset's version: given, set by the orchestrator, or from its manifest."""
        if self._data_version is None and self.dataset:
            self._data_version = dataset_manifest(self.dataset).version
        return self._data_version

    @data_version.setter
    def data_version(self, version: str | None) -> None:
        self._data_version = version

    def _store_config(self) -> dict[str, str] | None:
        """The config once per distinct content, referenced from every manifest by hash
        (a manifest stays small however large the config)."""
        if self.config is None or not self.leads:
            return None
        body = strict_json.dumps(self.config, sort_keys=True, indent=1).encode()
        sha = hashlib.sha256(body).hexdigest()
        key = f"{self.repo.prefix}/configs/{sha}.json"
        try:
            self.repo.store.put_new(key, body)
        except AlreadyExistsError:
            pass
        return {"sha256": sha, "uri": self.repo.store.uri_for(key)}

    # -- a finished run, and the generators an attempt began with ---------------------------
    def _done(self, manifest: Manifest | None) -> bool:
        """The checkpoint to continue from is the run's final one, and continuing past it
        was not asked for: by `continue_finished`, or by raising the run's target (a
        `max_steps` above the one it finished under: a script or config changed to train
        longer says so itself). A loop that stopped early under the same target (a loss
        low enough, early stopping) stays finished."""
        if manifest is None or manifest.meta.get("final") is not True:
            return False
        target = manifest.meta.get("max_steps")
        raised = (self.max_steps is not None and isinstance(target, int)
                  and self.max_steps > target)
        return not (self.triggers.continue_finished or raised)

    def _already_finished(self, manifest: Manifest) -> None:
        """A run that reached its final checkpoint is done: say so and end the process with
        0, whatever loop follows `restore` (an open-ended one would train past the end).
        Nothing is claimed, loaded or written."""
        self._closed = self._finishing = True
        self._stop_heartbeat()
        self.loop.step = manifest.step
        self._say(f"{self.experiment}/{self.run} already finished at step {manifest.step} "
                  f"({self.repo.uri(manifest.name)}); nothing to train. To train past its "
                  "end, pass continue_finished=True to CheckpointSession (config: "
                  "checkpoint.continue_finished: true), or start a new run")
        self.reporter.send(Finished(manifest.step, dict(manifest.meta.get("metrics") or {})))
        self.reporter.close()
        self._drop_exit_hooks()
        raise SystemExit(Outcome.SUCCESS.exit_code)

    def _compare_generators(self, manifest: Manifest | None, attempt: int, drawn: bool) -> None:
        """Name a resumed attempt whose generators began elsewhere than the first
        attempt's (`trainer.base.rng_identity`); a fresh start is the first attempt."""
        if manifest is None:
            self._rng_first = {"attempt": attempt, "identity": self._rng_start}
            return
        first = manifest.meta.get("rng_identity", {}).get("first") or {}
        if not first.get("identity"):
            return  # written before identities were recorded: nothing to compare
        self._rng_first = first
        names = rng_identity.differing(first["identity"], self._rng_start, drawn)
        if names and self.leads:
            loud, msg = rng_identity.warning_for(attempt, first["attempt"], names)
            if loud:
                self.reporter.log(msg, logging.WARNING)
            else:
                self._say(msg)

    def _rng_record(self) -> dict[str, Any]:
        """What each checkpoint records of the generators: this attempt's start and the
        first attempt's, which every later attempt is compared with."""
        return {"attempt": self._rng_start, "first": self._rng_first}

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
        # Most steps: the next one, a float loss, nothing due. Decided in a handful of
        # operations from what the last full call worked out (`_calm_until`: the first step
        # a step trigger fires; `_quiet_until`: when a time trigger or a progress report is
        # due), so the call costs about a microsecond; anything else takes the full path.
        if (type(step) is int and loop.step < step < self._calm_until and metrics is None
                and not epoch_end and (loss is None or type(loss) is float and isfinite(loss))
                and time.monotonic() < self._quiet_until and not self.stop.requested
                and not self._beat.fenced):
            self._beat.advance(step)
            if loss is not None:
                loop.losses.append(loss)
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
        surfaces at the next step, however soon it ended); inside `epochs()`; with several
        ranks (each step is agreed); with debug logging on (a line per step; switched on
        later, it is seen at the next full step, within `heartbeat_seconds`). Anything that
        moves these (a save, `epochs()`) sets `_calm_until` to 0: the next step plans again."""
        ck, c, done = self._ck, self.triggers, self.loop.step
        if (ck is None or ck.unsettled or self._walk is not None or self.ranks is not None
                or self._beat is None or log.isEnabledFor(logging.DEBUG)):
            self._calm_until = 0
            return
        due = MAX_STEP + 1
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
            reasons.append("final")
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
        this is the run's end (implied once the step reaches max_steps)."""
        loop = self.loop
        final = final or (self.max_steps is not None and loop.step >= self.max_steps)
        is_best = reason == "best" or self._loss_is_best()
        # Filled by the parts as the checkpointer takes their state, before the manifest is
        # written; a new dict per save, since a background commit may still hold the last.
        self._sizes = {}
        meta = {"reason": reason, "loss": loop.losses[-1] if loop.losses else None,
                "metrics": loop.metrics, "best_score": loop.best,
                "is_best": is_best, "lineage": self.lineage.to_dict(),
                "config": self._config_ref, "part_bytes": self._sizes, "final": final,
                "max_steps": self.max_steps, "rng_identity": self._rng_record(),
                **self._interval.meta()}
        if self._ck.last_saved_step != loop.step:
            self._last_final, self._last_ours = final, True
        self._ck.save(loop.step, meta)
        if final and self.ranks is not None:
            # Several ranks: the final commit's collectives run on the group, so it is done
            # before step() returns (a script may destroy the process group next).
            self._ck.wait()
        self._last_save_t = time.monotonic()
        self._calm_until = 0  # the time trigger starts over: the next step plans again
        self._warn_if_the_optimizer_dwarfs_the_model(self._sizes)

    def _on_commit(self, m: Manifest, stats: dict[str, Any]) -> None:
        self._interval.observe(stats)  # on the save's worker: the next interval uses it
        rec = CheckpointRecord.from_manifest(m, self.repo.uri(m.name), stats)
        loss = f", loss {rec.loss:.4g}" if isinstance(rec.loss, float) else ""
        stalled = (f"; stalled {rec.blocking_seconds:.4f}s"
                   if rec.blocking_seconds is not None else "")
        self._say(f"checkpoint committed: step {m.step}{loss} -> {rec.uri} ({rec.size} "
                  f"bytes, {rec.save_seconds:.2f}s){stalled}")
        self.reporter.send(rec)

    # -- the end --------------------------------------------------------------------------
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

    def __enter__(self) -> CheckpointSession:
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

    # -- without a `with` block -------------------------------------------------------------
    def _install_exit_hooks(self) -> None:
        if self._exit_hooks:
            return
        self._exit_hooks = True
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
        """The script ended normally: close the session as the end of the block would."""
        if self._finishing:
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

    def _warn_if_the_optimizer_dwarfs_the_model(self, sizes: dict[str, int]) -> None:
        if self._size_warned or not sizes:
            return
        models = [n for n, kind in self._part_kinds.items() if kind == "model"]
        model_bytes = sum(sizes.get(n, 0) for n in models)
        for name, kind in self._part_kinds.items():
            size = sizes.get(name, 0)
            if kind != "optimizer" or not model_bytes \
                    or size <= OPTIMIZER_SIZE_WARNING * model_bytes:
                continue
            self._size_warned = True
            self.reporter.log(
                f"checkpoint part {name!r} is {size / model_bytes:.0f}x the model "
                f"({human_bytes(size)} against {human_bytes(model_bytes)} in {', '.join(models)}), and "
                "every checkpoint carries it: that is the optimizer's own state (LBFGS keeps "
                "2 x history_size copies of the parameters). A smaller history or an "
                "optimizer with less state makes checkpoints smaller and faster.",
                logging.WARNING)

    # -- epochs of a hand-rolled batch loop ------------------------------------------------
    def position(self, batches_per_epoch: int) -> Position:
        """The epoch and batch to continue from after `restore`, with `batches_per_epoch`
        batches per epoch (`trainer.api.epochs.position_of`)."""
        if self._ck is None:
            raise ConfigError("call restore() before position(): the position is the "
                              "restored checkpoint's")
        return position_of(self.loop, batches_per_epoch)

    def epochs(self, epochs: int, batches_per_epoch: int, *, start: int = 0) -> Iterator[int]:
        """The epochs still to train, from the restored one, as `range(start, epochs)`
        numbers them (`start=1`: a loop over `range(1, n + 1)` becomes
        `ckpt.epochs(n + 1, batches_per_epoch, start=1)`); iterate `batches()` in each
        (`trainer.api.epochs.walk_epochs` says how a resume inside an epoch continues)."""
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= epochs:
            raise ConfigError(f"epochs(): start is {start!r}; pass the first epoch's number, "
                              f"from 0 to epochs ({epochs})")
        pos = self.position(batches_per_epoch)
        self._walk = EpochWalk(batches_per_epoch)
        self._calm_until = 0  # every batch's step is checked against the walk
        walk = walk_epochs(self.loop, self._walk, pos, epochs - start)
        return walk if not start else (epoch + start for epoch in walk)

    def batches(self, items: Iterable[Any] | None = None) -> Iterator[Any]:
        """The batch indices of the current epoch of `epochs()` still to train; or, given
        the epoch's `items` (`enumerate(range(0, n, bptt))`, a list of batches), those
        items from the one the epoch continues with."""
        if self._walk is None:
            raise ConfigError("batches() goes inside `for epoch in ckpt.epochs(epochs, "
                              "batches_per_epoch)`, which knows where the epoch continues")
        if self._kept is not None:
            self._kept.after_prologue(resumed_inside=self._walk.first > 0)
        indices = walk_batches(self._walk)
        if items is None:
            return indices
        # The indices first: zip asks them for each next item, so they see the epoch's end.
        return (item for _, item in zip(indices, itertools.islice(items, self._walk.first, None),
                                        strict=False))

    def keep(self, where: Any, *names: str) -> None:
        """Checkpoint the plain values `names` where they live, a dict (a script's
        `globals()`) or an object's attributes; before `restore`, which sets them back
        (`trainer.api.kept`)."""
        if self._ck is not None:
            raise ConfigError("keep() goes before restore(), which sets the kept values back")
        if self._kept is None:
            self._kept = Kept()
        self._kept.add(where, names)

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
