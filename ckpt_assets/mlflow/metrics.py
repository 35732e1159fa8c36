"""What the MLflow run records per committed checkpoint: its training loss, its size
(`checkpoint_bytes`, all its files), and the evaluations up to its step, as metric
histories over the global training step.

Metrics are logged only for committed checkpoints (the trainer reports a checkpoint after
latest.json moved), so a resumed attempt continues the same step axis. A step at or below
the last one already logged is never logged again (that happens only when a resume walked
back past a corrupt checkpoint), so each metric's history is strictly increasing in step.
"""

from __future__ import annotations

import math
import time
from typing import Any

from ckpt_assets.mlflow.run import MlflowRun
from trainer.contract import Eval
from trainer.records import CheckpointRecord
from trainer.repo import CheckpointRepo

# The size of each committed checkpoint (all its files), in bytes, over the step.
CHECKPOINT_BYTES = "checkpoint_bytes"
# The metrics whose last logged step a resumed attempt reads back before it logs more.
STEPPED_METRICS = ("loss", "eval_loss", "eval_accuracy", CHECKPOINT_BYTES)


class CheckpointMetrics:
    """Loss and eval histories of one MLflow run, each strictly increasing in step."""

    def __init__(self, run: MlflowRun):
        self.run = run
        self.last_step: dict[str, int] = {}
        self._pending_eval: list[Eval] = []

    def read_last_steps(self) -> None:
        """Where each history ends, as earlier attempts left it (raises on MLflow errors)."""
        for key in STEPPED_METRICS:
            hist = self.run.client.get_metric_history(self.run.run_id, key)
            if hist:
                self.last_step[key] = max(m.step for m in hist)

    def _log(self, key: str, value: Any, step: int) -> None:
        if value is None or not isinstance(value, int | float) or not math.isfinite(value):
            return
        if step <= self.last_step.get(key, -1):
            return
        self.run.client.log_metric(self.run.run_id, key, float(value), step=int(step),
                                   timestamp=int(time.time() * 1000))
        self.last_step[key] = int(step)

    def on_eval(self, msg: Eval) -> None:
        """An evaluation: logged once a checkpoint at or after its step is committed."""
        self._pending_eval.append(msg)

    def on_checkpoint(self, rec: CheckpointRecord) -> None:
        """A committed checkpoint: its loss, and the evals up to its step, become history."""
        if self.run.run_id is None:
            return
        step = rec.step
        try:
            for ev in [e for e in self._pending_eval if e.step <= step]:
                self._log("eval_loss", ev.metrics.get("loss"), ev.step)
                self._log("eval_accuracy", ev.metrics.get("accuracy"), ev.step)
            self._pending_eval = [e for e in self._pending_eval if e.step > step]
            self._log("loss", rec.loss, step)
            self._log(CHECKPOINT_BYTES, rec.size, step)
            self.run.client.set_tag(self.run.run_id, "last_checkpoint", rec.uri)
            self.run.client.set_tag(self.run.run_id, "last_committed_step", str(step))
        except Exception as e:
            self.run.warn(f"logging checkpoint step {step}", e)

    def backfill(self, repo: CheckpointRepo) -> int:
        """Log the loss of committed checkpoints that no attempt reported (e.g. the one a
        trainer committed on SIGTERM after its orchestrator was killed). Returns how many."""
        if self.run.run_id is None:
            return 0
        n = 0
        try:
            ptr = repo.read_pointer()
            names = ptr.timeline[::-1] if ptr else []
            for name in names:
                try:
                    m = repo.read_manifest(name)
                except Exception:  # removed by retention, or unreadable: nothing to log
                    continue
                if m.step > self.last_step.get("loss", -1):
                    self._log("loss", m.meta.get("loss"), m.step)
                    n += 1
                self._log(CHECKPOINT_BYTES, m.total_size, m.step)
        except Exception as e:
            self.run.warn("back-filling committed checkpoints", e)
        return n
