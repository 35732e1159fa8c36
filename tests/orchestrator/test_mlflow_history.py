"""MLflow's metric history of a training run holds each committed checkpoint once: those
reported before the MLflow run opened, those only the run's records still know, and never a
step twice however often it is reported or recorded; against a real local MLflow sqlite
store, without training anything."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from ckpt_assets.defs.resources import MLflowResource
from ckpt_assets.mlflow.tracking import MlflowTracker
from tests.dagster_fixtures import made_mlflow_db
from trainer.checkpoints.records import CheckpointRecord
from trainer.process.contract import Eval


class Log:
    def __init__(self):
        self.warnings: list[str] = []

    def warning(self, msg):
        self.warnings.append(msg)

    def info(self, msg):
        pass


@pytest.fixture
def resource(tmp_path) -> MLflowResource:
    return MLflowResource(tracking_uri=made_mlflow_db(tmp_path / "mlflow.db"))


def ckpt(step: int, attempt: int = 1) -> CheckpointRecord:
    return CheckpointRecord(name=f"step-{step:09d}-a{attempt}", uri=f"file:///s/{step}",
                            step=step, attempt=attempt, sha256="0" * 64, size=1000 + step,
                            loss=1.0 / step)


def history(resource: MLflowResource, t: MlflowTracker, key: str = "loss") -> list[tuple]:
    client = MlflowClient(tracking_uri=resource.resolved_tracking_uri)
    return sorted((m.step, m.value) for m in client.get_metric_history(t.run_id, key))


def test_checkpoints_reported_before_the_mlflow_run_opened_are_logged_when_it_opens(resource):
    t = MlflowTracker(resource, "exp", "late", Log())
    t.on_eval(Eval(step=10, metrics={"loss": 0.5}))
    for step in (10, 20, 30):
        t.on_checkpoint(ckpt(step))  # MLflow not open yet: nothing is lost
    assert t.start({"attempt": 1})
    t.on_checkpoint(ckpt(40))
    assert history(resource, t) == [(s, 1.0 / s) for s in (10, 20, 30, 40)]
    assert [s for s, _ in history(resource, t, "checkpoint_bytes")] == [10, 20, 30, 40]
    assert history(resource, t, "eval_loss") == [(10, 0.5)]
    tags = MlflowClient(tracking_uri=resource.resolved_tracking_uri).get_run(t.run_id).data.tags
    assert tags["last_committed_step"] == "40"


def test_a_catch_up_fills_the_holes_below_the_last_step_and_never_logs_a_step_twice(resource):
    log = Log()
    t = MlflowTracker(resource, "exp", "holes", log)
    assert t.start({"attempt": 2})
    for step in (110, 120):  # the newest attempt's reports, logged first
        t.on_checkpoint(ckpt(step, attempt=2))
    recorded = [ckpt(s) for s in range(10, 101, 10)]  # every attempt's records: retention
    # removed most of these from the store, their records stay
    assert t.catch_up(recorded) == 10
    # Replayed: the same reports again, the records again, one step recorded by two attempts.
    t.on_checkpoint(ckpt(120, attempt=2))
    assert t.catch_up([*recorded, ckpt(100, attempt=2)]) == 0
    assert history(resource, t) == [(s, 1.0 / s) for s in range(10, 121, 10)]
    tags = MlflowClient(tracking_uri=resource.resolved_tracking_uri).get_run(t.run_id).data.tags
    assert tags["last_committed_step"] == "120"  # not moved back by the older ones
    assert log.warnings == []


def test_two_trackers_of_one_mlflow_run_never_log_one_step_twice(resource):
    """A tracker whose opening outlasted its attempt, and the next attempt's, in one run
    worker: both catch up from the same records."""
    late = MlflowTracker(resource, "exp", "twice", Log())
    late.on_checkpoint(ckpt(10))
    nxt = MlflowTracker(resource, "exp", "twice", Log())
    assert nxt.start({"attempt": 2})
    assert nxt.catch_up([ckpt(10), ckpt(20)]) == 2
    assert late.start({"attempt": 1}) == nxt.run_id  # opens now, with its report of step 10
    assert late.catch_up([ckpt(10), ckpt(20), ckpt(30)]) == 1
    assert history(resource, nxt) == [(s, 1.0 / s) for s in (10, 20, 30)]


def test_a_reopened_tracker_reads_the_steps_an_earlier_process_logged(resource):
    first = MlflowTracker(resource, "exp", "reopen", Log())
    assert first.start({"attempt": 1})
    first.catch_up([ckpt(10), ckpt(20)])
    from ckpt_assets.mlflow import metrics

    metrics._LOGGED.clear()  # what a new run worker knows: only what MLflow holds
    second = MlflowTracker(resource, "exp", "reopen", Log())
    assert second.start({"attempt": 2}) == first.run_id
    assert second.catch_up([ckpt(10), ckpt(20), ckpt(30)]) == 1
    assert [s for s, _ in history(resource, second)] == [10, 20, 30]
