"""What the MLflow run records per committed checkpoint: its training loss, its size
(`checkpoint_bytes`, all its files), and the evaluations up to its step, as metric
histories over the global training step.

Metrics are logged only for committed checkpoints (the trainer reports a checkpoint after
latest.json moved), so a resumed attempt continues the same step axis. Each metric has at
most ONE point per step: a step the history already holds is never logged again (a replayed
report, a checkpoint recorded twice, a resume that walked back past a corrupt checkpoint
and committed the same step anew), so a history equals the run's checkpoints step for step.

The history is complete even when MLflow opens late (its start-up waits behind other run
workers' database migrations, or fails for a whole attempt): checkpoints reported before the
run opened are kept and logged when it opens, and `catch_up` logs those that only the
attempts' own records still know (retention may have removed them from the store).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable
from typing import Any

from ckpt_assets.mlflow.run import MlflowRun
from trainer.checkpoints.records import CheckpointRecord
from trainer.checkpoints.repo import CheckpointRepo
from trainer.process.contract import Eval

# The size of each committed checkpoint (all its files), in bytes, over the step.
CHECKPOINT_BYTES = "checkpoint_bytes"
# The metrics whose logged steps an opening tracker reads back before it logs more.
STEPPED_METRICS = ("loss", "eval_loss", "eval_accuracy", CHECKPOINT_BYTES)

# The steps each MLflow run's histories hold, shared by every tracker of this process under
# one lock: a tracker whose opening outlasted its attempt may still be logging when the next
# attempt's tracker (an in-run relaunch) or final_model's opens, and reading MLflow's history
# alone would let both log the same step. Keyed by (tracking URI, run id).
_LOGGED: dict[tuple[str, str], dict[str, set[int]]] = {}
_LOCK = threading.RLock()


def _finite(value: Any) -> bool:
    return value is not None and isinstance(value, int | float) and math.isfinite(value)


class CheckpointMetrics:
    """Loss and eval histories of one MLflow run, at most one point per step each."""

    def __init__(self, run: MlflowRun):
        self.run = run
        self._pending_eval: list[Eval] = []
        self._unlogged: list[CheckpointRecord] = []  # reported before the run opened
        self._logged: dict[str, set[int]] | None = None  # None until the run is open

    @property
    def last_step(self) -> dict[str, int]:
        """Where each history ends."""
        with _LOCK:
            return {k: max(v) for k, v in (self._logged or {}).items() if v}

    def opened(self) -> None:
        """The run is open: read which steps its histories hold (earlier attempts', other
        processes'), then log what was reported while it was not. Raises on MLflow errors."""
        with _LOCK:
            key = (self.run.resource.resolved_tracking_uri, str(self.run.run_id))
            logged = _LOGGED.setdefault(key, {})
            for metric in STEPPED_METRICS:
                hist = self.run.client.get_metric_history(self.run.run_id, metric)
                logged.setdefault(metric, set()).update(int(m.step) for m in hist)
            self._logged = logged
            waiting, self._unlogged = self._unlogged, []
        if waiting:
            self.catch_up(waiting)

    def _log(self, key: str, value: Any, step: int) -> bool:
        """Log `value` at `step` unless the history holds that step (call under _LOCK)."""
        steps = self._logged.setdefault(key, set())
        if not _finite(value) or int(step) in steps:
            return False
        self.run.client.log_metric(self.run.run_id, key, float(value), step=int(step),
                                   timestamp=int(time.time() * 1000))
        steps.add(int(step))
        return True

    def on_eval(self, msg: Eval) -> None:
        """An evaluation: logged once a checkpoint at or after its step is committed."""
        with _LOCK:
            self._pending_eval.append(msg)

    def on_checkpoint(self, rec: CheckpointRecord) -> None:
        """A committed checkpoint: its loss, and the evals up to its step, become history;
        kept for the opening when the run is not open yet."""
        with _LOCK:
            if self._logged is None:
                self._unlogged.append(rec)
                return
        self.catch_up([rec])

    def catch_up(self, records: Iterable[CheckpointRecord]) -> int:
        """Log the loss and size of each committed checkpoint in `records` at a step the
        histories do not hold yet, oldest step first, with the evals up to it. Returns how
        many losses were logged (0 while the run is not open)."""
        n, step = 0, None
        with _LOCK:
            if self._logged is None or self.run.run_id is None:
                return 0
            try:
                ordered = sorted(records, key=lambda r: (r.step, r.attempt))
                for rec in ordered:
                    step = rec.step
                    self._log_evals_up_to(step)
                    n += self._log("loss", rec.loss, step)
                    self._log(CHECKPOINT_BYTES, rec.size, step)
                if ordered:
                    self._set_last_tags(ordered[-1])
            except Exception as e:
                self.run.warn(f"logging checkpoint step {step}", e)
        return n

    def _log_evals_up_to(self, step: int) -> None:
        for ev in [e for e in self._pending_eval if e.step <= step]:
            self._log("eval_loss", ev.metrics.get("loss"), ev.step)
            self._log("eval_accuracy", ev.metrics.get("accuracy"), ev.step)
        self._pending_eval = [e for e in self._pending_eval if e.step > step]

    def _set_last_tags(self, rec: CheckpointRecord) -> None:
        """The newest checkpoint's tags; never moved back by an older one caught up late."""
        if rec.step < max(self._logged.get(CHECKPOINT_BYTES) or {rec.step}):
            return
        self.run.client.set_tag(self.run.run_id, "last_checkpoint", rec.uri)
        self.run.client.set_tag(self.run.run_id, "last_committed_step", str(rec.step))

    def backfill(self, repo: CheckpointRepo) -> int:
        """Log the committed checkpoints the store still holds on the run's timeline that no
        attempt reported (e.g. the one a trainer committed on SIGTERM after its
        orchestrator was killed). Returns how many losses were logged."""
        if self.run.run_id is None:
            return 0
        found = []
        try:
            ptr = repo.read_pointer()
            for name in (ptr.timeline[::-1] if ptr else []):
                try:
                    m = repo.read_manifest(name)
                except Exception:  # removed by retention, or unreadable: nothing to log
                    continue
                found.append(CheckpointRecord.from_manifest(m, repo.uri(m.name)))
        except Exception as e:
            self.run.warn("back-filling committed checkpoints", e)
        return self.catch_up(found)
