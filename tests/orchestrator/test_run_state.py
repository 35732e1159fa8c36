"""A training run's state at a glance: derived from its newest training run, shown by
`ckpt-assets list`, and recorded on the partition each time the sensors or a stop change it.
Fast: runs are records in an ephemeral instance, nothing trains."""

from __future__ import annotations

import time

import dagster as dg
import pytest

from ckpt_assets.base.clock import iso
from ckpt_assets.base.events import STATE, partition_events
from ckpt_assets.base.registration import register_training_run
from ckpt_assets.base.tags import (
    TAG_ATTEMPT,
    TAG_DECIDED_AT,
    TAG_DECISION,
    TAG_DECISION_REASON,
    TAG_NO_RESUME,
    TAG_PARENT_RUN_ID,
    TAG_RESUME_AT,
    TAG_STOP_REASON,
)
from ckpt_assets.defs.resources import CheckpointStore
from ckpt_assets.lifecycle.decision import due_resume
from ckpt_assets.lifecycle.state import State, run_state
from ckpt_assets.lifecycle.stop import stop_training_run
from ckpt_assets.records.listing import run_summary
from tests import dagster_runs

KEY = "glance"
S = dg.DagsterRunStatus


@pytest.fixture
def instance():
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def run_with(instance, status: S, tags: dict | None = None, job: str = "train_job"):
    return dagster_runs.run_in_status(instance, KEY, status, tags, job)


def state(instance) -> State:
    return run_state(instance, KEY).state


def recorded_states(instance) -> list[str]:
    return [md["state"] for md, _ in partition_events(instance, KEY, STATE)]


def test_a_run_never_launched_is_not_launched(instance):
    assert state(instance) == State.NOT_LAUNCHED


@pytest.mark.parametrize("status", [S.QUEUED, S.NOT_STARTED, S.STARTING])
def test_a_first_attempt_waiting_to_start_is_queued_and_a_resume_is_resuming(instance, status):
    run_with(instance, status)
    assert state(instance) == State.QUEUED
    run_with(instance, status, {TAG_PARENT_RUN_ID: "parent-id", TAG_ATTEMPT: "2"})
    got = run_state(instance, KEY)
    assert got.state == State.RESUMING and got.attempt == 2 and "parent-id" in got.detail


def test_a_running_attempt_is_training_and_says_which_attempt(instance):
    dagster_runs.started_run(instance, KEY, tags={TAG_ATTEMPT: "3", TAG_PARENT_RUN_ID: "p"})
    got = run_state(instance, KEY)
    assert got.state == State.TRAINING and got.attempt == 3
    assert str(got).startswith("training: attempt 3, continuing run p")


def test_a_succeeded_run_is_finished(instance):
    run_with(instance, S.SUCCESS)
    assert state(instance) == State.FINISHED


def test_a_failed_run_before_the_sensors_decided_is_deciding(instance):
    dagster_runs.lost_worker_run(instance, KEY)
    assert state(instance) == State.DECIDING


def test_a_resume_after_a_back_off_is_waiting_until_it_is_due_then_resuming(instance):
    now = time.time()
    run = run_with(instance, S.FAILURE, {TAG_DECISION: "resume", TAG_DECIDED_AT: iso(now),
                                         TAG_RESUME_AT: iso(now + 30),
                                         TAG_DECISION_REASON: "resumed after 30s: storage"})
    waiting = run_state(instance, KEY, now=now)
    assert waiting.state == State.WAITING and waiting.resume_at == iso(now + 30)
    assert "in 30s" in waiting.detail and "storage" in waiting.detail
    assert run_state(instance, KEY, now=now + 31).state == State.RESUMING
    assert run.run_id == waiting.dagster_run_id


def test_a_failure_the_policy_does_not_resume_is_stopped_by_policy_with_its_reason(instance):
    run_with(instance, S.FAILURE, {TAG_DECISION: "stop",
                                   TAG_DECISION_REASON: "not resumed: a bug in user code"})
    got = run_state(instance, KEY)
    assert got.state == State.STOPPED_BY_POLICY and got.detail == "not resumed: a bug in user code"


def test_a_run_stopped_for_good_is_stopped_by_user_with_the_users_reason(instance):
    run_with(instance, S.CANCELED, {TAG_NO_RESUME: "true", TAG_STOP_REASON: "wrong lr",
                                    TAG_DECISION: "stop"})
    got = run_state(instance, KEY)
    assert got.state == State.STOPPED_BY_USER and "wrong lr" in got.detail


def test_a_newer_run_of_another_job_on_the_partition_does_not_hide_the_training_state(instance):
    run_with(instance, S.FAILURE, {TAG_DECISION: "stop", TAG_DECISION_REASON: "diverged"})
    run_with(instance, S.SUCCESS, job="check_training_run")
    assert state(instance) == State.STOPPED_BY_POLICY


def test_the_sensors_decision_is_recorded_on_the_partition_as_the_new_state(
        instance, checkpoint_store):
    run = dagster_runs.canceled_run(instance, KEY)  # a termination: a preemption
    assert due_resume(instance, run, checkpoint_store) is not None
    assert recorded_states(instance) == [State.RESUMING.value]
    # One observation per decision: the new state, carrying the decision that led to it.
    (md, rec), = partition_events(instance, KEY)
    assert (md["event"], md["failed_run_id"], md["decision"]) == (STATE, run.run_id, "resume")
    desc = rec.event_log_entry.asset_observation.description
    assert desc.startswith("state: resuming: launching the resume; resumed at once")


def test_a_stop_is_recorded_on_the_partition_as_stopped_by_user(instance):
    dagster_runs.lost_worker_run(instance, KEY)  # ended, not decided yet: a resume pending
    assert stop_training_run(instance, KEY, "done with it")
    assert recorded_states(instance)[-1] == State.STOPPED_BY_USER.value
    assert state(instance) == State.STOPPED_BY_USER


def test_ckpt_assets_list_rows_carry_the_state_the_detail_and_the_latest_step(instance, tmp_path):
    store = CheckpointStore(uri=str(tmp_path / "store")).open()
    register_training_run(store, KEY, {"max_steps": 100})
    run_with(instance, S.FAILURE, {TAG_DECISION: "stop", TAG_DECISION_REASON: "diverged"})
    row = run_summary(instance, store, KEY)
    assert (row["state"], row["detail"], row["latest_step"], row["max_steps"]) == (
        "stopped by policy", "diverged", None, 100)


def test_the_training_job_names_the_state_knows_are_the_code_locations_training_jobs():
    from ckpt_assets.base.names import TRAINING_JOB_NAMES
    from ckpt_assets.defs.jobs import JOBS, train_demo, train_job

    assert TRAINING_JOB_NAMES == {train_job.name, train_demo.name}
    assert {j.name for j in JOBS} - TRAINING_JOB_NAMES == {"check_training_run",
                                                           "stop_training_run",
                                                           "new_training_run"}


# -- what `list` says when no dagster-daemon is running ------------------------------------

NO_DAEMON = "which is resumed, but no daemon is running: run `dagster-daemon run`"


def _beat(instance, daemon_type: str, at: float) -> None:
    from dagster._daemon.types import DaemonHeartbeat

    instance.add_daemon_heartbeat(DaemonHeartbeat(at, daemon_type, None, None))


def _listed(instance, tmp_path) -> dict:
    store = CheckpointStore(uri=str(tmp_path / "store")).open()
    register_training_run(store, KEY, {"max_steps": 100})
    return run_summary(instance, store, KEY)


@pytest.mark.parametrize("beat_age", [None, 10_000.0])
def test_a_failed_run_awaiting_its_decision_without_a_daemon_says_what_to_run(
        instance, tmp_path, beat_age):
    from dagster._daemon.daemon import SensorDaemon

    if beat_age is not None:  # a daemon that ran once, long ago
        _beat(instance, SensorDaemon.daemon_type(), time.time() - beat_age)
    dagster_runs.lost_worker_run(instance, KEY)
    row = _listed(instance, tmp_path)
    assert row["state"] == State.DECIDING.value
    assert row["detail"].startswith(f"attempt 1 ended worker_lost, {NO_DAEMON}")
    assert f"python -m ckpt_assets run {KEY}" in row["detail"]
    assert "within seconds" not in row["detail"]  # no promise nobody keeps


def test_a_failed_run_awaiting_its_decision_with_a_live_daemon_keeps_the_promise(
        instance, tmp_path):
    from dagster._daemon.daemon import SensorDaemon

    _beat(instance, SensorDaemon.daemon_type(), time.time())
    dagster_runs.lost_worker_run(instance, KEY)
    row = _listed(instance, tmp_path)
    assert row["state"] == State.DECIDING.value
    assert "the resume sensors decide within seconds" in row["detail"]
    assert "no daemon" not in row["detail"]


def test_a_resume_due_without_a_daemon_is_not_promised_either(instance, tmp_path):
    run_with(instance, S.FAILURE, {TAG_DECISION: "resume", TAG_RESUME_AT: iso(time.time() - 1),
                                   TAG_DECISION_REASON: "resumed at once: preempted"})
    row = _listed(instance, tmp_path)
    assert row["state"] == State.RESUMING.value and NO_DAEMON in row["detail"]


def test_a_queued_run_without_a_daemon_says_it_stays_queued_until_one_dequeues_it(
        instance, tmp_path):
    from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import (
        QueuedRunCoordinatorDaemon,
    )

    run_with(instance, S.QUEUED)
    assert "stays queued until `dagster-daemon run`" in _listed(instance, tmp_path)["detail"]
    _beat(instance, QueuedRunCoordinatorDaemon.daemon_type(), time.time())
    assert "no daemon" not in _listed(instance, tmp_path)["detail"]


def test_a_state_that_could_not_be_recorded_is_logged_and_fails_nothing(
        instance, monkeypatch, caplog):
    # Best-effort for people, never what a decision rests on; but a lost state event must
    # not pass unseen. The move's own writes are made all the same.
    from ckpt_assets.lifecycle import transition as moves

    def locked(*_a, **_k):
        raise RuntimeError("database is locked")

    run = run_with(instance, S.STARTED)
    monkeypatch.setattr(moves, "state_observation", locked)
    moved = moves.transition(instance, KEY, moves.Event.STOP_REQUESTED,
                             lambda w: w.tag(run.run_id, {TAG_NO_RESUME: "true"}))
    assert moved.row.next is State.STOPPING
    assert instance.get_run_by_id(run.run_id).tags[TAG_NO_RESUME] == "true"
    (record,) = [r for r in caplog.records if "could not record the state" in r.message]
    assert KEY in record.message and record.exc_info[1].args == ("database is locked",)


def test_a_run_terminated_from_dagster_is_terminating_and_one_stopped_for_good_is_stopping(
        instance):
    run_with(instance, S.CANCELING)
    assert state(instance) == State.TERMINATING  # a preemption: it is resumed once it ends
    run_with(instance, S.CANCELING, {TAG_NO_RESUME: "true"})
    assert state(instance) == State.STOPPING
