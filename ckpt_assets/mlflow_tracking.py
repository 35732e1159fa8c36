"""MLflow tracking of a training run: ONE MLflow run per training run, found by the tag `training_run=<partition key>`
in the MLflow experiment and created if missing; every attempt continues it. Metrics are
logged with step = the global training step, and only for committed checkpoints (the
trainer reports a checkpoint after latest.json moved), so a resumed attempt continues the
same step axis. A step at or below the last one already logged is never logged again
(that happens only when a resume walked back past a corrupt checkpoint), so each metric's
history is strictly increasing in step.

What else the MLflow run carries: the registered training config as params (flattened,
`optim.lr`; MLflow params are immutable, so each key is logged once per MLflow run and a
later attempt skips keys already there); each attempt's start as tags `attempt_<n>.*`, and
a resumed attempt's seam as the metric `resumed_at_step` (value and step = the step it
resumed from); a failed attempt's class and reason as tags `attempt_<n>.failure_class`,
`attempt_<n>.failure_reason`, `last_failure_class`, `last_failure_reason` (a traceback as
the artifact `failures/attempt_<n>.traceback.txt`). Final models are registered under one
registered model per MLflow experiment (named like it), one version per training run,
tagged `training_run`.

MLflow is a view of the run, not its source of truth (the store and the Dagster event log
are): any MLflow error is logged as a warning and training goes on.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from trainer.contract import Eval, Started
from trainer.records import CheckpointRecord
from trainer.repo import CheckpointRepo

TRAINING_RUN_TAG = "training_run"

# MLflow's limits (mlflow.utils.validation): longer values are refused, not truncated.
PARAM_VALUE_MAX = 6000
PARAM_KEY_MAX = 250
TAG_VALUE_MAX = 5000  # the store allows 8000; a reason longer than this is a log, not a tag
PARAMS_PER_BATCH = 100


def flatten_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: `{"optim": {"lr": 0.1}}` -> `{"optim.lr": "0.1"}`.

    Lists are JSON (a param is one string); None is left out (MLflow has no null, and "None"
    would read as a value someone chose). Keys keep MLflow's allowed characters only."""
    out: dict[str, str] = {}
    for k, v in config.items():
        key = f"{prefix}{_param_key(str(k))}"
        if isinstance(v, dict):
            out.update(flatten_params(v, f"{key}."))
        elif v is None:
            continue
        else:
            text = json.dumps(v, sort_keys=True) if isinstance(v, list | tuple) else str(v)
            out[key[:PARAM_KEY_MAX]] = text[:PARAM_VALUE_MAX]
    return out


def _param_key(k: str) -> str:
    return "".join(c if c.isalnum() or c in "_-. /" else "_" for c in k) or "_"


def mlflow_run_url(tracking_uri: str, experiment_id: str | None, run_id: str | None) -> str | None:
    """The MLflow UI page of a run, when the tracking server is one (http/https)."""
    if not run_id or not experiment_id or not tracking_uri.startswith(("http://", "https://")):
        return None
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


class MlflowTracker:
    """The MLflow run of one training run. Every method is best-effort (warns, never raises)."""

    def __init__(self, resource, experiment: str, training_run: str, log=None):
        self.resource = resource
        self.experiment = experiment
        self.training_run = training_run
        self.log = log
        self.client = None
        self.run_id: str | None = None
        self.experiment_id: str | None = None
        self.last_step: dict[str, int] = {}
        self._pending_eval: list[Eval] = []

    # -- plumbing ---------------------------------------------------------------------------
    def _warn(self, what: str, e: BaseException) -> None:
        msg = f"MLflow: {what} failed ({type(e).__name__}: {e}); training is not affected"
        if self.log:
            self.log.warning(msg)

    def start(self, tags: dict[str, str] | None = None) -> str | None:
        """Find or create the MLflow run; mark it RUNNING; set `tags`. Returns its id."""
        if not self.resource.enabled:
            return None
        try:
            self.client = self.resource.client()
            self.run_id = find_or_create_run(self.client, self.resource, self.experiment,
                                             self.training_run)
            self.client.update_run(self.run_id, status="RUNNING")
            self.experiment_id = self.client.get_run(self.run_id).info.experiment_id
            for k, v in (tags or {}).items():
                if v is not None:
                    self.client.set_tag(self.run_id, k, str(v))
            for key in ("loss", "eval_loss", "eval_accuracy"):
                hist = self.client.get_metric_history(self.run_id, key)
                if hist:
                    self.last_step[key] = max(m.step for m in hist)
        except Exception as e:
            self._warn("opening the run", e)
            self.run_id = None
        return self.run_id

    @property
    def run_url(self) -> str | None:
        """The MLflow UI page of the run (only for an http(s) tracking server)."""
        return mlflow_run_url(self.resource.resolved_tracking_uri, self.experiment_id,
                              self.run_id)

    def log_config(self, config: dict[str, Any]) -> int:
        """The training config as params, once per MLflow run. Returns how many were new.

        A key already logged with the same value is skipped (every resumed attempt gets
        here); one logged with another value keeps its first value (MLflow refuses to
        change a param) and is named in a warning."""
        if self.run_id is None:
            return 0
        try:
            from mlflow.entities import Param

            flat = flatten_params(config)
            logged = self.client.get_run(self.run_id).data.params
            new = {k: v for k, v in flat.items() if k not in logged}
            changed = sorted(k for k, v in flat.items() if k in logged and logged[k] != v)
            items = sorted(new.items())
            for i in range(0, len(items), PARAMS_PER_BATCH):
                self.client.log_batch(self.run_id, params=[
                    Param(k, v) for k, v in items[i:i + PARAMS_PER_BATCH]])
            if changed and self.log:
                self.log.warning(f"MLflow: params {', '.join(changed)} were logged earlier with "
                                 "other values, which MLflow keeps (params are immutable)")
            return len(new)
        except Exception as e:
            self._warn("logging the config as params", e)
            return 0

    def on_started(self, msg: Started) -> None:
        """An attempt's trainer started: tag the attempt; mark the seam of a resume."""
        if self.run_id is None:
            return
        n, resumed = msg.attempt, msg.resumed_from_step
        try:
            tags = {f"attempt_{n}.dagster_run_id": msg.lineage.get("dagster_run_id"),
                    f"attempt_{n}.resumed_from_step": resumed,
                    f"attempt_{n}.resumed_from": msg.resumed_from,
                    f"attempt_{n}.start": "resumed" if resumed is not None else "fresh"}
            for k, v in tags.items():
                if v is not None:
                    self.client.set_tag(self.run_id, k, str(v)[:TAG_VALUE_MAX])
            if resumed is not None:
                # Not through _log: a resume may land on a step already marked (a second
                # resume from the same checkpoint), and each resume is a fact of its own.
                self.client.log_metric(self.run_id, "resumed_at_step", float(resumed),
                                       step=int(resumed), timestamp=int(time.time() * 1000))
        except Exception as e:
            self._warn(f"marking the start of attempt {n}", e)

    def on_failure(self, attempt: int, failure_class: str, reason: str,
                   traceback: str | None = None) -> None:
        """A failed (or interrupted) attempt: its class and reason, per attempt and last."""
        if self.run_id is None:
            return
        reason = reason[:TAG_VALUE_MAX]
        try:
            self.client.set_tag(self.run_id, f"attempt_{attempt}.failure_class", failure_class)
            self.client.set_tag(self.run_id, f"attempt_{attempt}.failure_reason", reason)
            self.client.set_tag(self.run_id, "last_failure_class", failure_class)
            self.client.set_tag(self.run_id, "last_failure_reason", reason)
            self.client.set_tag(self.run_id, "last_failed_attempt", str(attempt))
            if traceback:
                self.client.log_text(self.run_id, traceback,
                                     f"failures/attempt_{attempt}.traceback.txt")
        except Exception as e:
            self._warn(f"recording the failure of attempt {attempt}", e)

    def _log(self, key: str, value: Any, step: int) -> None:
        if value is None or not isinstance(value, int | float) or not math.isfinite(value):
            return
        if step <= self.last_step.get(key, -1):
            return
        self.client.log_metric(self.run_id, key, float(value), step=int(step),
                               timestamp=int(time.time() * 1000))
        self.last_step[key] = int(step)

    # -- events from the trainer ------------------------------------------------------------
    def on_eval(self, msg: Eval) -> None:
        self._pending_eval.append(msg)

    def on_checkpoint(self, rec: CheckpointRecord) -> None:
        """A committed checkpoint: its loss, and the evals up to its step, become history."""
        if self.run_id is None:
            return
        step = rec.step
        try:
            for ev in [e for e in self._pending_eval if e.step <= step]:
                self._log("eval_loss", ev.metrics.get("loss"), ev.step)
                self._log("eval_accuracy", ev.metrics.get("accuracy"), ev.step)
            self._pending_eval = [e for e in self._pending_eval if e.step > step]
            self._log("loss", rec.loss, step)
            self.client.set_tag(self.run_id, "last_checkpoint", rec.uri)
            self.client.set_tag(self.run_id, "last_committed_step", str(step))
        except Exception as e:
            self._warn(f"logging checkpoint step {step}", e)

    def backfill(self, repo: CheckpointRepo) -> int:
        """Log the loss of committed checkpoints that no attempt reported (e.g. the one a
        trainer committed on SIGTERM after its orchestrator was killed). Returns how many."""
        if self.run_id is None:
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
        except Exception as e:
            self._warn("back-filling committed checkpoints", e)
        return n

    def finish(self, status: str) -> None:
        """FINISHED / FAILED / KILLED; a later attempt sets it back to RUNNING."""
        if self.run_id is None:
            return
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as e:
            self._warn(f"marking the run {status}", e)

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.run_id is None:
            return
        try:
            for k, v in tags.items():
                if v is not None:
                    self.client.set_tag(self.run_id, k, str(v)[:TAG_VALUE_MAX])
        except Exception as e:
            self._warn("setting tags", e)

    @property
    def registered_model_name(self) -> str:
        """One registered model per MLflow experiment, named like it."""
        return self.resource.experiment_name or self.experiment

    def log_final_model(self, weights_path: str, metrics: dict[str, float], step: int,
                        description: str) -> str | None:
        """Log the exported weights + final metrics; register a model version if enabled."""
        if self.run_id is None:
            return None
        version = None
        try:
            for k, v in metrics.items():
                if isinstance(v, int | float) and math.isfinite(v):
                    self.client.log_metric(self.run_id, f"final_{k}", float(v), step=int(step))
            self.client.log_artifact(self.run_id, weights_path, artifact_path="model")
            if self.resource.register_model:
                version = self._register(description, step)
        except Exception as e:
            self._warn("logging the final model", e)
        return version

    def _register(self, description: str, step: int) -> str:
        """The training run's version of the experiment's registered model (created once;
        a later final_model of the same run updates it: its source, the run's `model`
        artifact, is the same path and now holds the newer weights)."""
        name = self.registered_model_name
        try:
            self.client.get_registered_model(name)
        except Exception:
            try:
                self.client.create_registered_model(
                    name, description=f"final models of the training runs of experiment {name}")
            except Exception:  # created concurrently by another training run
                self.client.get_registered_model(name)
        existing = self.client.search_model_versions(
            f"name = '{name}' and run_id = '{self.run_id}'")
        if existing:
            mv = max(existing, key=lambda v: int(v.version))
            self.client.update_model_version(name, mv.version, description=description)
        else:
            run = self.client.get_run(self.run_id)
            mv = self.client.create_model_version(
                name, source=f"{run.info.artifact_uri}/model", run_id=self.run_id,
                description=description, tags={"training_run": self.training_run})
        for k, v in {"training_run": self.training_run, "experiment": self.experiment,
                     "step": str(step)}.items():
            self.client.set_model_version_tag(name, mv.version, k, v)
        return f"{name}/{mv.version}"


def find_or_create_run(client, resource, experiment: str, training_run: str) -> str:
    """The MLflow run tagged `training_run=<key>` in the experiment (oldest if several)."""
    name = resource.experiment_name or experiment
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            exp_id = client.create_experiment(
                name, artifact_location=resource.resolved_artifact_location())
        except Exception:  # created concurrently
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
            exp_id = exp.experiment_id
    else:
        exp_id = exp.experiment_id

    def search():
        return client.search_runs(
            [exp_id], filter_string=f"tags.{TRAINING_RUN_TAG} = '{training_run}'",
            order_by=["attributes.start_time ASC"], max_results=10)

    runs = search()
    if runs:
        return runs[0].info.run_id
    created = client.create_run(exp_id, run_name=training_run,
                                tags={TRAINING_RUN_TAG: training_run,
                                      "ckpt.experiment": experiment})
    runs = search()
    if runs and runs[0].info.run_id != created.info.run_id:
        client.delete_run(created.info.run_id)  # lost a creation race: keep the oldest
        return runs[0].info.run_id
    return created.info.run_id
