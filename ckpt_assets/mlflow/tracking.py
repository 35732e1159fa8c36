"""MLflow tracking of a training run: ONE MLflow run per training run, found by the tag
`training_run=<partition key>` in the MLflow experiment and created if missing; every
attempt continues it.

What it records, by module:

* `ckpt_assets.mlflow.run`: the run's lifecycle. The registered training config as params
  (flattened, `optim.lr`; MLflow params are immutable, so each key is logged once per
  MLflow run and a later attempt skips keys already there); each attempt's start as tags
  `attempt_<n>.*`, and a resumed attempt's seam as the metric `resumed_at_step` (value and
  step = the step it resumed from); a failed attempt's class and reason as tags
  `attempt_<n>.failure_class`, `attempt_<n>.failure_reason`, `last_failure_class`,
  `last_failure_reason` (a traceback as the artifact `failures/attempt_<n>.traceback.txt`).
* `ckpt_assets.mlflow.metrics`: per committed checkpoint, its loss and the evaluations up
  to its step, logged with step = the global training step, one point per step across
  attempts; checkpoints committed before the run opened are caught up from the attempts'
  own records (`catch_up`), also those retention removed from the store.
* `ckpt_assets.mlflow.models`: the final model's weights and metrics, and its version of
  the registered model (one per MLflow experiment, one version per training run, tagged
  `training_run`).

MLflow is a view of the run, not its source of truth (the store and the Dagster event log
are): any MLflow error is logged as a warning and training goes on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ckpt_assets.mlflow.metrics import CheckpointMetrics
from ckpt_assets.mlflow.models import FinalModel
from ckpt_assets.mlflow.run import (
    TRAINING_RUN_TAG,
    MlflowRun,
    find_or_create_run,
    flatten_params,
    mlflow_run_url,
)
from trainer.checkpoints.records import CheckpointRecord
from trainer.checkpoints.repo import CheckpointRepo
from trainer.process.contract import Eval, Started

# The loss plot's artifact path (`log_loss_plot`).
LOSS_PLOT = "plots/loss.png"

__all__ = ["LOSS_PLOT", "TRAINING_RUN_TAG", "MlflowTracker", "find_or_create_run", "flatten_params",
           "mlflow_run_url"]


class MlflowTracker:
    """The MLflow run of one training run, as the training assets use it: the run's
    lifecycle (`MlflowRun`), its checkpoint metrics (`CheckpointMetrics`) and its final
    model (`FinalModel`) behind one object. Every method is best-effort (warns, never
    raises)."""

    def __init__(self, resource, experiment: str, training_run: str, log=None):
        self.mlflow_run = MlflowRun(resource, experiment, training_run, log)
        self.metrics = CheckpointMetrics(self.mlflow_run)
        self.final_model = FinalModel(self.mlflow_run)

    # -- the run ----------------------------------------------------------------------------
    @property
    def resource(self):
        return self.mlflow_run.resource

    @property
    def experiment(self) -> str:
        return self.mlflow_run.experiment

    @property
    def training_run(self) -> str:
        return self.mlflow_run.training_run

    @property
    def client(self):
        return self.mlflow_run.client

    @client.setter
    def client(self, client) -> None:
        self.mlflow_run.client = client

    @property
    def run_id(self) -> str | None:
        return self.mlflow_run.run_id

    @run_id.setter
    def run_id(self, run_id: str | None) -> None:
        self.mlflow_run.run_id = run_id

    @property
    def experiment_id(self) -> str | None:
        return self.mlflow_run.experiment_id

    @property
    def run_url(self) -> str | None:
        """The MLflow UI page of the run (only for an http(s) tracking server)."""
        return self.mlflow_run.run_url

    def start(self, tags: dict[str, str] | None = None) -> str | None:
        """Find or create the MLflow run; mark it RUNNING; set `tags`. Returns its id."""
        if not self.resource.enabled:
            return None
        try:
            self.mlflow_run.open(tags)
            self.metrics.opened()
        except Exception as e:
            self.mlflow_run.warn("opening the run", e)
            self.mlflow_run.run_id = None
        return self.run_id

    def log_config(self, config: dict[str, Any]) -> int:
        return self.mlflow_run.log_config(config)

    def on_started(self, msg: Started) -> None:
        self.mlflow_run.on_started(msg)

    def on_failure(self, attempt: int, failure_class: str, reason: str,
                   traceback: str | None = None) -> None:
        self.mlflow_run.on_failure(attempt, failure_class, reason, traceback)

    def finish(self, status: str) -> None:
        self.mlflow_run.finish(status)

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.mlflow_run.set_tags(tags)

    def log_loss_plot(self, png: bytes | None) -> None:
        """The loss plot with each resume marked (dashed), as the artifact LOSS_PLOT."""
        if png:
            self.mlflow_run.log_artifact_bytes(png, LOSS_PLOT)

    # -- checkpoint metrics -------------------------------------------------------------------
    @property
    def last_step(self) -> dict[str, int]:
        return self.metrics.last_step

    def on_eval(self, msg: Eval) -> None:
        self.metrics.on_eval(msg)

    def on_checkpoint(self, rec: CheckpointRecord) -> None:
        self.metrics.on_checkpoint(rec)

    def backfill(self, repo: CheckpointRepo) -> int:
        return self.metrics.backfill(repo)

    def catch_up(self, records: Iterable[CheckpointRecord]) -> int:
        return self.metrics.catch_up(records)

    # -- the final model ----------------------------------------------------------------------
    @property
    def registered_model_name(self) -> str:
        return self.final_model.registered_model_name

    def log_final_model(self, weights_path: str, metrics: dict[str, float], step: int,
                        description: str) -> str | None:
        return self.final_model.log_final_model(weights_path, metrics, step, description)
