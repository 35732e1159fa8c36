"""The MLflow run of a training run, and what it records of the run's lifecycle: the run
itself (found by the tag `training_run=<partition key>`, created if missing, RUNNING while
an attempt trains and FINISHED / FAILED / KILLED after), the registered config as params,
each attempt's start and, for a failed attempt, its class and reason.

Every method is best-effort: an MLflow error is a warning, never an exception.
"""

from __future__ import annotations

import json
import time
from typing import Any

from trainer.process.contract import Started

TRAINING_RUN_TAG = "training_run"
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"  # the MLflow UI's model-training view
# The MLflow UI (3.x) shows an experiment in the view of the browser's *workflow type*, which
# starts as GenAI (traces, token usage) and wins over the experiment's kind tag; a link that
# names it lands on the training runs whatever the browser chose before.
TRAINING_VIEW = "workflowType=machine_learning"

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
    """The MLflow UI page of a run, when `tracking_uri` (or the UI's base URL) is an
    http(s) server."""
    if not run_id or not experiment_id or not tracking_uri.startswith(("http://", "https://")):
        return None
    return (f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"
            f"?{TRAINING_VIEW}")


# What MLflow's table creation raises on a database whose creation was interrupted or raced
# (alembic's leftover batch table, a revision row another process moved on).
HALF_MADE = ("_alembic_tmp_", "Online migration expected to match one row")


def half_made(e: BaseException) -> bool:
    return any(sign in str(e) for sign in HALF_MADE)


class MlflowRun:
    """The MLflow run of one training run: its client and id once opened (`run_id` stays
    None while MLflow is off or could not be reached, and every record is then skipped)."""

    def __init__(self, resource, experiment: str, training_run: str, log=None):
        self.resource = resource
        self.experiment = experiment
        self.training_run = training_run
        self.log = log
        self.client = None
        self.run_id: str | None = None
        self.experiment_id: str | None = None

    def warn(self, what: str, e: BaseException) -> None:
        msg = f"MLflow: {what} failed ({type(e).__name__}: {e}); training is not affected"
        if half_made(e):
            msg += (f". The MLflow database of {self.resource.resolved_tracking_uri} was left "
                    "half made (two processes created its tables at once); move it aside, "
                    "and the next run creates a new one")
        if self.log:
            self.log.warning(msg)

    def open(self, tags: dict[str, str] | None = None) -> str:
        """Find or create the MLflow run; mark it RUNNING; set `tags`. Raises on errors."""
        self.client = self.resource.client()
        self.run_id = find_or_create_run(self.client, self.resource, self.experiment,
                                         self.training_run)
        self.client.update_run(self.run_id, status="RUNNING")
        self.experiment_id = self.client.get_run(self.run_id).info.experiment_id
        for k, v in (tags or {}).items():
            if v is not None:
                self.client.set_tag(self.run_id, k, str(v))
        return self.run_id

    def attach(self) -> bool:
        """Find (or create) the MLflow run without marking it RUNNING, for a record about an
        attempt that has ended (its decider's); False, with a warning, if MLflow is off or
        cannot be reached."""
        if not getattr(self.resource, "enabled", True):
            return False
        try:
            self.client = self.resource.client()
            self.run_id = find_or_create_run(self.client, self.resource, self.experiment,
                                             self.training_run)
        except Exception as e:
            self.warn("finding the run", e)
            self.run_id = None
        return self.run_id is not None

    @property
    def run_url(self) -> str | None:
        """The MLflow UI page of the run (only for an http(s) tracking server)."""
        return mlflow_run_url(self.resource.resolved_ui_url, self.experiment_id, self.run_id)

    def finish(self, status: str) -> None:
        """FINISHED / FAILED / KILLED; a later attempt sets it back to RUNNING."""
        if self.run_id is None:
            return
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as e:
            self.warn(f"marking the run {status}", e)

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.run_id is None:
            return
        try:
            for k, v in tags.items():
                if v is not None:
                    self.client.set_tag(self.run_id, k, str(v)[:TAG_VALUE_MAX])
        except Exception as e:
            self.warn("setting tags", e)

    def log_artifact_bytes(self, data: bytes, artifact_file: str) -> None:
        """`data` as the run's artifact `artifact_file` (the loss plot: MLflow's charts have
        no API for marks on a metric's curve, so the resumes are drawn in the image)."""
        if self.run_id is None:
            return
        try:
            import tempfile
            from pathlib import Path

            where = Path(artifact_file)
            with tempfile.TemporaryDirectory() as d:
                path = Path(d) / where.name
                path.write_bytes(data)
                self.client.log_artifact(self.run_id, str(path), where.parent.as_posix()
                                         if where.parent != Path(".") else None)
        except Exception as e:
            self.warn(f"logging the artifact {artifact_file}", e)

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
            self.warn("logging the config as params", e)
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
                # Not through the metrics' once-per-step rule: a resume may land on a step
                # already marked (a second resume from the same checkpoint), and each resume
                # is a fact of its own.
                self.client.log_metric(self.run_id, "resumed_at_step", float(resumed),
                                       step=int(resumed), timestamp=int(time.time() * 1000))
        except Exception as e:
            self.warn(f"marking the start of attempt {n}", e)

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
            self.warn(f"recording the failure of attempt {attempt}", e)


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
    if exp is None or exp.tags.get(EXPERIMENT_KIND_TAG) is None:
        # MLflow 3 guesses an untagged experiment's kind and may open it on its (empty) GenAI
        # view; a training run's experiment opens on the runs and their metrics.
        client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)

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
