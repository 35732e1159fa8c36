"""`stop_training_run`: a training run stopped from the UI ends and is never resumed.

Fast: run records of train_job on a temporary instance (no worker behind them), the stop
job executed in process, and the sensors' own decision function asked afterwards."""

from __future__ import annotations

import time

import dagster as dg
import pytest
import yaml as yamllib

from ckpt_assets.base.tags import (
    PARTITION_TAG,
    TAG_DECISION,
    TAG_NO_RESUME,
    TAG_STOP_REASON,
)
from ckpt_assets.defs.jobs import stop_training_run_job
from ckpt_assets.lifecycle.decision import due_resume
from ckpt_assets.lifecycle.decision_record import (
    DecisionRecord,
    create_once,
    mirror_tags,
    read_decision,
)
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import NO_COMPUTE_LOGS, instance_in
from tests.dagster_runs import run_in_status

S = dg.DagsterRunStatus


@pytest.fixture
def instance(dagster_home):
    # On disk, with the DefaultRunLauncher a deployment has (an ephemeral instance's
    # in-memory launcher cannot terminate anything).
    with instance_in(dagster_home, NO_COMPUTE_LOGS) as inst:
        yield inst


def _stop(instance: dg.DagsterInstance, name: str, **config) -> dg.ExecuteInJobResult:
    return stop_training_run_job.execute_in_process(
        instance=instance, raise_on_error=False,
        run_config={"ops": {"stop_training_run_op": {"config": {"training_run": name, **config}}}})


def _resumed(instance: dg.DagsterInstance, run: dg.DagsterRun, store) -> bool:
    """Whether the reconciler, the one launcher of resumes, would launch a resume of `run`."""
    return due_resume(instance, instance.get_run_by_id(run.run_id), store) is not None


def test_a_stopped_queued_run_is_canceled_tagged_and_never_resumed(instance, checkpoint_store):
    run = run_in_status(instance, "queued-run", S.QUEUED)
    other = run_in_status(instance, "other-run", S.QUEUED)
    result = _stop(instance, "queued-run", reason="wrong learning rate")
    assert result.success
    stopped = instance.get_run_by_id(run.run_id)
    assert stopped.status == S.CANCELED
    assert stopped.tags[TAG_NO_RESUME] == "true"
    assert stopped.tags[TAG_STOP_REASON] == "wrong learning rate"
    assert not _resumed(instance, stopped, checkpoint_store)
    assert instance.get_run_by_id(run.run_id).tags[TAG_DECISION] == "stop"
    # Another training run is left alone; the stop job's own run is findable by its target.
    assert instance.get_run_by_id(other.run_id).status == S.QUEUED
    assert instance.get_run_by_id(result.run_id).tags["ckpt/stop_target"] == "queued-run"
    assert PARTITION_TAG not in instance.get_run_by_id(result.run_id).tags


def test_a_stopped_started_run_is_tagged_asked_to_terminate_and_never_resumed(instance, checkpoint_store):
    run = run_in_status(instance, "started-run", S.STARTED)
    assert _stop(instance, "started-run").success
    stopped = instance.get_run_by_id(run.run_id)
    # Termination was requested; with no worker to reach, run monitoring would finish it.
    assert stopped.status == S.CANCELING
    assert stopped.tags[TAG_NO_RESUME] == "true"
    instance.report_run_canceled(stopped)  # what run monitoring does after its timeout
    assert not _resumed(instance, stopped, checkpoint_store)


def test_a_forced_stop_marks_a_started_run_canceled_at_once(instance, checkpoint_store):
    run = run_in_status(instance, "gone-worker", S.STARTED)
    assert _stop(instance, "gone-worker", force=True).success
    stopped = instance.get_run_by_id(run.run_id)
    assert stopped.status == S.CANCELED and stopped.tags[TAG_NO_RESUME] == "true"
    assert not _resumed(instance, stopped, checkpoint_store)


def test_a_stop_during_a_resume_back_off_withdraws_the_pending_resume(instance, checkpoint_store):
    run = run_in_status(instance, "backing-off", S.FAILURE)
    rec = DecisionRecord(run.run_id, "backing-off", True, "transient", "storage_unavailable",
                         "resumed after a back-off", time.time() - 3600, time.time() - 3570,
                         "", 1, None)
    assert create_once(checkpoint_store.open(), rec)[1]
    instance.add_run_tags(run.run_id, mirror_tags(rec))
    assert _resumed(instance, run, checkpoint_store)  # due: the reconciler's next sweep would resume it
    assert _stop(instance, "backing-off").success
    assert not _resumed(instance, run, checkpoint_store)
    tags = instance.get_run_by_id(run.run_id).tags
    # Withdrawn by the stop's tag; the decision itself is a record, never rewritten.
    assert tags[TAG_NO_RESUME] == "true" and tags[TAG_DECISION] == "resume"
    assert read_decision(checkpoint_store.open(), "backing-off", run.run_id) == rec


def test_stopping_a_training_run_that_does_not_exist_fails_with_its_name(instance):
    result = _stop(instance, "no-such-run")
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "no-such-run" in failure.step_failure_data.user_failure_data.description
    result = _stop(instance, "Bad/Name")
    assert not result.success


def test_a_check_run_of_the_partition_is_neither_stopped_nor_in_the_way(instance):
    from ckpt_assets.base.queries import active_runs

    check = run_in_status(instance, "checked", S.QUEUED, job="check_training_run")
    assert active_runs(instance, "checked") == []
    assert _stop(instance, "checked").success
    assert instance.get_run_by_id(check.run_id).status == S.QUEUED


@pytest.mark.parametrize("yaml", ["dagster_home/dagster.yaml", "deploy/postgres/dagster.yaml"])
def test_a_stop_from_the_ui_is_never_queued_behind_training_runs_of_which_four_run_at_once(yaml):
    # The queue's own counter (what the daemon's dequeue asks), on the instance file's limits.
    from dagster._utils.tags import TagConcurrencyLimitsCounter

    from ckpt_assets.base.names import STOP_JOB, TRAIN_JOB
    from tests.daemon_harness import ROOT

    queue = yamllib.safe_load((ROOT / yaml).read_text())["run_coordinator"]["config"]
    assert queue["max_concurrent_runs"] == -1  # only the tag limits hold runs back

    def run(job: str, partition: str | None) -> dg.DagsterRun:
        return dg.DagsterRun(job_name=job, tags={PARTITION_TAG: partition} if partition else {})

    training = [run(TRAIN_JOB, f"r{i}") for i in range(4)]
    counter = TagConcurrencyLimitsCounter(queue["tag_concurrency_limits"], training)
    assert not counter.is_blocked(run(STOP_JOB, None))
    assert counter.is_blocked(run(TRAIN_JOB, "r4"))  # a fifth training run waits
    partial = TagConcurrencyLimitsCounter(queue["tag_concurrency_limits"], training[:3])
    assert counter.is_blocked(run(TRAIN_JOB, "r0")) and partial.is_blocked(run(TRAIN_JOB, "r0"))
    assert not partial.is_blocked(run(TRAIN_JOB, "r4"))
