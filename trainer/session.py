"""`CheckpointSession`: make your own training loop crash-safe and auto-resuming.

    from trainer import CheckpointSession

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
input, 3 unloadable checkpoint, 4 divergence, 5 store unavailable, 6 superseded, 1 a bug.

When the orchestrator starts the script ($CKPT_RUN set), its run, experiment, store,
dataset and attempt take precedence over the arguments, which serve standalone runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trainer.checkpointer import Checkpointer, RNGState
from trainer.code_version import ckpt_assets_version, code_version_of
from trainer.config import CheckpointConfig, parse
from trainer.contract import (
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
from trainer.dataset import check_same_data, dataset_manifest
from trainer.errors import AlreadyExistsError, ConfigError, DivergedError
from trainer.interval import SaveInterval
from trainer.manifest import Manifest
from trainer.outcomes import Outcome
from trainer.records import CheckpointRecord, Lineage
from trainer.repo import CheckpointRepo
from trainer.report import Reporter, report_failure
from trainer.signals import StopRequest
from trainer.storage import open_store, split_uri

log = logging.getLogger("trainer")

RESERVED_PARTS = ("loop", "rng")


@dataclass
class LoopState:
    """The session's own counters and history: part of every checkpoint."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    best_score: float = math.inf
    metrics: dict[str, float] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "losses": torch.tensor(self.losses, dtype=torch.float64),
                "best_score": self.best_score, "metrics": dict(self.metrics)}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.step = int(s["step"])
        self.losses = s["losses"].tolist()
        self.best_score = float(s["best_score"])
        self.metrics = dict(s["metrics"])


class DictPart:
    """A user's dict of plain values (numbers, strings, tensors, lists), restored in place."""

    def __init__(self, values: dict[str, Any]):
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.clear()
        self.values.update(state)


def _as_part(name: str, obj: Any) -> Any:
    if name in RESERVED_PARTS:
        raise ConfigError(f"checkpoint part name {name!r} is reserved for the session's own "
                          f"state ({', '.join(RESERVED_PARTS)}); rename your part")
    if isinstance(obj, dict):
        return DictPart(obj)
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return obj
    raise ConfigError(f"checkpoint part {name!r} is a {type(obj).__name__} without "
                      "state_dict()/load_state_dict(); pass an object that has both, or a dict "
                      "of plain values")


def seed_all(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators: the session saves all three, so a
    script that seeds only one would still write different bytes on every fresh start."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class CheckpointSession:
    def __init__(self, *, run: str | None = None, experiment: str | None = None,
                 store: str | None = None, resume: str | None = None,
                 max_steps: int | None = None, best_metric: str = "loss",
                 config: dict[str, Any] | None = None, dataset: str | None = None,
                 data_version: str | None = None, code_path: str | None = None,
                 seed: int | None = None, install_signals: bool = True, **triggers: Any):
        if seed is not None:
            seed_all(seed)
        # Launched by the orchestrator: its run, experiment, store, dataset and attempt win
        # over the arguments (which serve standalone runs), so a script cannot write into
        # another run than the one it was launched for.
        self.launch = launched = LaunchEnv.from_env()
        if launched is not None:
            self.run, self.experiment = launched.run, launched.experiment
            self.store_uri = launched.store_uri or store or os.path.abspath("checkpoints")
            self.dataset = launched.dataset_uri or dataset
            self._data_version = launched.data_version or data_version
            if launched.heartbeat_seconds:
                # The orchestrator judges liveness by heartbeats: its interval holds.
                triggers["heartbeat_seconds"] = launched.heartbeat_seconds
            self.resume = resume or launched.resume_from or "auto"
        else:
            self.run, self.experiment = run or "run", experiment or "default"
            self.store_uri = (store or os.environ.get(Env.STORE_URI)
                              or os.path.abspath("checkpoints"))
            self.dataset, self._data_version = dataset, data_version
            self.resume = (resume or os.environ.get(Env.RESUME_FROM)
                           or os.environ.get(RESUME_FROM_ALIAS) or "auto")
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
            self.stop.install(exit_with_parent=bool(launched and launched.exit_with_parent))
        self.loop = LoopState()
        self.stopped = False
        self.lineage: Lineage | None = None
        self.repo: CheckpointRepo | None = None
        self._ck: Checkpointer | None = None
        self._last_save_t = time.monotonic()
        self._last_beat = 0.0
        self._closed = False

    # -- resume -------------------------------------------------------------------------
    def restore(self, parts: dict[str, Any] | None = None, /, **named: Any) -> int:
        """Register the named parts, load the checkpoint to continue from (if any), and
        return the step it holds (0: start fresh)."""
        if self._ck is not None:
            raise ConfigError("restore() was called twice; call it once, after every part exists")
        all_parts = {**(parts or {}), **named}
        wrapped = {name: _as_part(name, obj) for name, obj in all_parts.items()}
        wrapped.update(loop=self.loop, rng=RNGState())

        store = open_store(self.store_uri)
        store.check_reachable()
        repo = self.repo = CheckpointRepo(store, self.experiment, self.run)
        data_version = self.data_version
        manifest, skipped = resolve_resume(repo, self.resume)
        if manifest is not None:
            lineage = Lineage.from_dict(manifest.meta.get("lineage"))
            check_same_data(lineage.data_version, data_version, repo.uri(manifest.name))
        attempt = repo.claim(manifest.name if manifest else None,
                             at_least=self.launch.attempt if self.launch else 1)
        ck = self._ck = Checkpointer(repo, wrapped, attempt, self.triggers.keep_last,
                                     self.triggers.keep_best, self.triggers.async_save)
        ck.on_commit = self._on_commit
        if manifest is not None:
            t0 = time.perf_counter()
            ck.load(manifest)
            ck.last_saved_step = manifest.step
            self.reporter.log(f"resumed from {repo.uri(manifest.name)} at step {manifest.step} "
                              f"(restore {time.perf_counter() - t0:.2f}s)")
        else:
            self.reporter.log(f"starting {self.experiment}/{self.run} from scratch "
                              f"(attempt {attempt})")
        self.lineage = self._lineage(attempt, manifest, data_version)
        self._config_ref = self._store_config()
        self.reporter.send(Started(
            attempt, self.lineage.resumed_from_step,
            repo.uri(manifest.name) if manifest else None,
            [Skipped(n, r) for n, r in skipped], self.max_steps, self.lineage.to_dict()))
        self._last_save_t = time.monotonic()
        return self.loop.step

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
        if self.config is None:
            return None
        body = json.dumps(self.config, sort_keys=True, indent=1).encode()
        sha = hashlib.sha256(body).hexdigest()
        key = f"{self.repo.prefix}/configs/{sha}.json"
        try:
            self.repo.store.put_new(key, body)
        except AlreadyExistsError:
            pass
        return {"sha256": sha, "uri": self.repo.store.uri_for(key)}

    # -- the per-step call -----------------------------------------------------------------
    def step(self, step: int, *, loss: float | torch.Tensor | None = None,
             metrics: dict[str, float] | None = None, epoch_end: bool = False) -> bool:
        """Record step `step` as done; commit if a trigger fires; True: stop the loop now."""
        if self._ck is None:
            raise ConfigError("call restore() with your parts before the first step()")
        self._ck.raise_if_failed()  # a background save's error fails the attempt here
        if loss is not None:
            loss = float(loss)
            if not math.isfinite(loss):
                raise DivergedError(
                    f"loss is {loss} at step {step}; the last good checkpoint is step "
                    f"{self._ck.last_saved_step}. Lower the learning rate or check the data, "
                    "then start a new run.")
            self.loop.losses.append(loss)
        self.loop.step = step
        log.debug("step %d done loss %r", step, loss)
        reasons = self._triggered(step, metrics, epoch_end)
        if self.stop.requested:
            self.reporter.log(f"{self.stop.signal_name}: committing a checkpoint at step {step}")
            self.save("preempted")
            self._ck.close()
            self.stopped = True
            self.reporter.send(Stopped(step, self.stop.signal_name))
            return True
        if reasons:
            self.save("best" if "best" in reasons else reasons[0])
        self._heartbeat(step)
        return False

    def _triggered(self, step: int, metrics: dict[str, float] | None,
                   epoch_end: bool) -> list[str]:
        c, reasons = self.triggers, []
        if metrics:
            self.loop.metrics = {k: float(v) for k, v in metrics.items()}
            self.reporter.send(Eval(step, dict(self.loop.metrics)))
            score = self.loop.metrics.get(self.best_metric, math.inf)
            if score < self.loop.best_score:
                self.loop.best_score = score
                if c.on_best:
                    reasons.append("best")
        if c.every_steps and step % c.every_steps == 0:
            reasons.append("interval")
        if self._interval.due(time.monotonic() - self._last_save_t):
            reasons.append("time")
        if c.on_epoch_end and epoch_end:
            reasons.append("epoch_end")
        if self.max_steps is not None and step >= self.max_steps:
            reasons.append("final")
        return reasons

    def _heartbeat(self, step: int) -> None:
        now, every = time.monotonic(), self.triggers.heartbeat_seconds
        if now - self._last_beat >= every:
            self._last_beat = now
            self.repo.heartbeat({"step": step, "attempt": self.lineage.attempt,
                                 "pid": os.getpid()})
            self.reporter.send(Progress(step, self.loop.losses[-1] if self.loop.losses else None))

    @property
    def stop_requested(self) -> bool:
        """A SIGTERM/SIGINT arrived (or the orchestrator died); `step` will stop the loop."""
        return self.stop.requested

    # -- saving ---------------------------------------------------------------------------
    def save(self, reason: str = "manual") -> None:
        """Commit the parts as they are now, at the current step (once per step)."""
        loop = self.loop
        meta = {"reason": reason, "loss": loop.losses[-1] if loop.losses else None,
                "metrics": loop.metrics, "best_score": loop.best_score,
                "is_best": reason == "best", "lineage": self.lineage.to_dict(),
                "config": self._config_ref, **self._interval.meta()}
        self._ck.save(loop.step, meta)
        self._last_save_t = time.monotonic()

    def _on_commit(self, m: Manifest, stats: dict[str, Any]) -> None:
        self._interval.observe(stats)  # on the save's worker: the next interval uses it
        rec = CheckpointRecord.from_manifest(m, self.repo.uri(m.name), stats)
        loss = f", loss {rec.loss:.4g}" if isinstance(rec.loss, float) else ""
        self.reporter.log(f"checkpoint committed: step {m.step}{loss} -> {rec.uri} ({rec.size} "
                          f"bytes, {rec.save_seconds:.2f}s); stalled {rec.blocking_seconds:.4f}s")
        self.reporter.send(rec)

    # -- the end --------------------------------------------------------------------------
    def close(self) -> None:
        """Commit the last step if no trigger did, wait for background saves, report the
        end. Called by the `with` block on success; call it yourself without one."""
        if self._closed or self._ck is None:
            return
        self._closed = True
        if not self.stopped and self.loop.step > 0 and self._ck.last_saved_step != self.loop.step:
            self.save("final")
        self._ck.close()
        if not self.stopped:
            self.reporter.send(Finished(self.loop.step, dict(self.loop.metrics)))
            self.reporter.log(f"training finished at step {self.loop.step}: {self.loop.metrics}")

    def __enter__(self) -> CheckpointSession:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, Exception):
            return False  # SystemExit, KeyboardInterrupt: not ours to translate
        code = 0
        try:
            if exc is None:
                self.close()
                code = (Outcome.PREEMPTED if self.stopped else Outcome.SUCCESS).exit_code
        except Exception as e:  # a failed final commit is the attempt's failure
            exc = e
        if exc is not None:
            if self._ck is not None:
                try:
                    self._ck.close()
                except Exception:  # the original error is the one to report
                    log.exception("background save failed while stopping")
            code = report_failure(exc, self.reporter)
        self.reporter.close()
        if code:
            raise SystemExit(code)
        return False


def resolve_resume(repo: CheckpointRepo, resume: str) -> tuple[Manifest | None, list]:
    """The checkpoint to resume from: 'auto', 'never', or an explicit checkpoint URI."""
    if resume == "never":
        return None, []
    if resume == "auto":
        return repo.find_latest_valid()
    store_uri, key = split_uri(resume)
    name = key.rsplit("/", 1)[1]
    if f"{repo.experiment}/{repo.run}" != key.rsplit("/", 2)[0].removesuffix("/checkpoints"):
        raise ConfigError(
            f"resume point {resume!r} belongs to another experiment/run than "
            f"{repo.experiment}/{repo.run}; a run resumes only from its own checkpoints "
            "(pass one of them, or auto)"
        )
    if open_store(store_uri).uri != repo.store.uri:
        raise ConfigError(f"resume point {resume!r} is not in the store {repo.store.uri}; "
                          "pass the store that holds it")
    return repo.verify(name), []
