"""A training run's life read and written through one owner per change: a stop has one
name everywhere, a read never writes, a re-run after a killed `ckpt-assets run` is its
child, a relaunched trainer is judged from its own start, and `list` never says
`deciding` for an outcome the policy does not resume."""

from __future__ import annotations

import subprocess
import time

import dagster as dg
import pytest

from ckpt_assets.base.attempt_processes import AttemptProcesses
from ckpt_assets.base.end import AttemptEnd
from ckpt_assets.base.tags import (
    TAG_ATTEMPT,
    TAG_DECISION,
    TAG_FAILURE_CLASS,
    TAG_HEARTBEAT_LOST,
    TAG_INTERRUPTED,
    TAG_NO_RESUME,
    TAG_PARENT_RUN_ID,
    TAG_PROCESSES,
    TAG_ROOT_RUN_ID,
)
from ckpt_assets.base.view import RunView
from ckpt_assets.lifecycle.decision import due_resume
from ckpt_assets.lifecycle.decision_record import DecisionRecord, create_once, read_decision
from ckpt_assets.lifecycle.ended import failure_of, named_end
from ckpt_assets.lifecycle.liveness import judge
from ckpt_assets.lifecycle.rerun import rerun_tags
from ckpt_assets.lifecycle.settings import ResumeSettings
from ckpt_assets.lifecycle.state import State, run_state, state_of, without_daemon
from ckpt_assets.lifecycle.stop import stop_training_run
from tests import dagster_runs
from trainer.base.outcomes import Outcome
from trainer.base.process_id import ProcessId
from trainer.checkpoints.records import Beat

KEY = "seams"


@pytest.fixture
def instance():
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def _dead_worker() -> ProcessId:
    proc = subprocess.Popen(["sleep", "60"])
    ref = ProcessId.of(proc.pid)
    proc.kill()
    proc.wait()
    return ref


def _killed_cli_run(instance) -> dg.DagsterRun:
    """What a SIGKILLed `ckpt-assets run` leaves: a STARTED run whose worker (the CLI's own
    process) is gone."""
    worker = _dead_worker()
    procs = AttemptProcesses(worker, worker, "/tmp/ckpt-seams.log")
    return dagster_runs.started_run(instance, KEY, tags={TAG_PROCESSES: procs.to_tag()})


def test_a_stop_is_named_stopped_by_user_in_the_attempts_end_the_decision_and_the_state(
        instance, store):
    run = dagster_runs.started_run(instance, KEY)
    stop_training_run(instance, KEY, "wrong lr", force=True)
    run = instance.get_run_by_id(run.run_id)
    assert failure_of(instance, run, None).outcome is Outcome.STOPPED_BY_USER
    assert due_resume(instance, run, store) is None  # never resumed
    decided = RunView.of(instance.get_run_by_id(run.run_id))
    assert (decided.decision, decided.failure_kind, decided.failure_class) == \
        ("stop", "stopped_by_user", "stopped_by_user")
    state = run_state(instance, KEY)
    assert state.state == State.STOPPED_BY_USER and state.outcome == "stopped_by_user"


@pytest.mark.slow
def test_reading_a_run_whose_worker_died_leaves_it_as_it_was(instance):
    run = _killed_cli_run(instance)
    state = run_state(instance, KEY)
    assert state.state == State.TRAINING and "run worker" in state.detail
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED


@pytest.mark.slow
def test_a_rerun_after_a_killed_cli_run_is_linked_as_the_killed_runs_child(instance):
    killed = _killed_cli_run(instance)
    tags = rerun_tags(instance, KEY)
    assert tags == {TAG_PARENT_RUN_ID: killed.run_id, TAG_ROOT_RUN_ID: killed.run_id,
                    TAG_ATTEMPT: "2", TAG_INTERRUPTED: "1:worker_lost"}
    ended = instance.get_run_by_id(killed.run_id)
    assert ended.status == dg.DagsterRunStatus.FAILURE
    assert failure_of(instance, ended, None).outcome is Outcome.WORKER_LOST


def test_a_trainer_relaunched_in_its_run_is_not_judged_dead_before_its_first_beat():
    settings = ResumeSettings(heartbeat_timeout_s=20.0, worker_grace_s=60.0)
    now = time.time()
    # Attempt 1 beat last 40 s ago and died; attempt 2 was relaunched 14 s ago in the same
    # run and has not beaten yet (its start-up is slow on a loaded machine).
    old = Beat(time=now - 40, pid=1, step=6, attempt=1, dagster_run_id="r")
    assert judge(old, "r", now - 14, now, settings, attempt=2) is None
    # Judged from its own start, it is declared dead once its start-up grace is over.
    late = judge(old, "r", now - 61, now, settings, attempt=2)
    assert late is not None and late.outcome is Outcome.HEARTBEAT_LOST
    # The old attempt's beat still counts against a run that is on attempt 1.
    assert judge(old, "r", now - 100, now, settings, attempt=1).outcome is \
        Outcome.HEARTBEAT_LOST


@pytest.mark.parametrize("outcome", [Outcome.USER_CODE_ERROR, Outcome.NO_CHECKPOINT])
def test_without_a_daemon_an_outcome_never_resumed_is_named_and_not_deciding(
        instance, outcome):
    run = dagster_runs.lost_worker_run(instance, KEY)
    state = without_daemon(instance, state_of(run, time.time(), outcome))
    assert state.state == State.STOPPED_BY_POLICY
    assert outcome.value in state.detail and "deciding" not in state.detail
    assert outcome.kind.advice in state.detail


def test_without_a_daemon_an_outcome_that_is_resumed_says_how_to_resume_it(instance):
    run = dagster_runs.lost_worker_run(instance, KEY)
    state = without_daemon(instance, state_of(run, time.time(), Outcome.PREEMPTED))
    assert state.state == State.DECIDING and state.outcome == "preempted"
    assert f"python -m ckpt_assets run {KEY}" in state.detail


def test_the_run_view_parses_the_attempt_tag_once_for_every_reader(instance):
    first = dagster_runs.started_run(instance, KEY)
    assert (RunView.of(first).attempt, RunView.of(first).attempt_tagged) == (1, False)
    bad = dagster_runs.started_run(instance, KEY, tags={TAG_ATTEMPT: "x"})
    assert RunView.of(bad).attempt == 1
    third = dagster_runs.started_run(instance, KEY, tags={TAG_ATTEMPT: "3",
                                                           TAG_FAILURE_CLASS: "preempted"})
    assert RunView.of(third).attempt == 3 and RunView.of(third).failure_class == "preempted"


# -- one decision per ended attempt, by construction ------------------------------------------

class _Store:
    def __init__(self, store):
        self.store = store

    def open(self):
        return self.store


@pytest.fixture
def store(tmp_path):
    from ckpt_assets.base.registration import register_training_run
    from trainer.storage import open_store

    s = open_store(str(tmp_path / "store"))
    register_training_run(s, KEY, {"max_steps": 100})
    return _Store(s)


def test_two_deciders_of_one_ended_run_create_one_decision_and_both_act_on_it(
        instance, store):
    run = dagster_runs.lost_worker_run(instance, KEY)
    first = due_resume(instance, run, store)
    second = due_resume(instance, run, store)  # the other failure sensor
    assert first is not None and second is not None
    assert first.run_key == second.run_key == f"resume-{run.run_id}"  # launched once
    rec = read_decision(store.open(), KEY, run.run_id)
    assert rec.resume and rec.failure_class == "worker_lost"
    events = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)
    assert sum("Resuming now" in (e.message or "") for e in events) == 1


def test_a_decision_whose_tags_were_dropped_is_acted_on_and_mirrored_again(instance, store):
    run = dagster_runs.lost_worker_run(instance, KEY)
    # Another decider created the decision; a concurrent rewrite of the run's record then
    # dropped the tags it wrote.
    rec, created = create_once(store.open(), DecisionRecord(
        run.run_id, KEY, True, "killed", "worker_lost", "resumed: run worker lost",
        time.time() - 60, None, "transient=1", 1, None))
    assert created and TAG_DECISION not in instance.get_run_by_id(run.run_id).tags
    req = due_resume(instance, run, store)
    assert req is not None and req.tags[TAG_ATTEMPT] == "2"
    assert instance.get_run_by_id(run.run_id).tags[TAG_DECISION] == "resume"
    # A later decider's own, different view loses to the record.
    assert create_once(store.open(), DecisionRecord(
        run.run_id, KEY, False, "bug", "user_code_error", "no", time.time(), None, "", 1,
        None)) == (rec, False)


def test_a_stop_withdraws_a_decided_resume_without_rewriting_the_decision(instance, store):
    run = dagster_runs.lost_worker_run(instance, KEY)
    assert due_resume(instance, run, store) is not None
    stop_training_run(instance, KEY, "enough")
    assert due_resume(instance, run, store) is None
    assert read_decision(store.open(), KEY, run.run_id).resume  # the record stands
    assert run_state(instance, KEY).state == State.STOPPED_BY_USER


def test_a_run_that_did_not_succeed_never_exits_0_from_ckpt_assets_run():
    from ckpt_assets.cli.run_here import failed_exit_code

    assert failed_exit_code(143, "preempted") == 143
    assert failed_exit_code(0, Outcome.NO_CHECKPOINT.value) != 0
    assert failed_exit_code(0, Outcome.UNFINISHED.value) != 0
    assert failed_exit_code(0, None) == Outcome.USER_CODE_ERROR.exit_code


@pytest.mark.parametrize("tags, status, exit_outcome, named", [
    # Dagster's terminate reaches the trainer as SIGTERM: 143 is the terminate's echo.
    ({}, dg.DagsterRunStatus.CANCELING, Outcome.PREEMPTED, Outcome.TERMINATED),
    ({}, dg.DagsterRunStatus.CANCELED, Outcome.KILLED_BY_SIGNAL, Outcome.TERMINATED),
    # The reconciler tags its verdict before it stops the trainer.
    ({TAG_HEARTBEAT_LOST: "trainer heartbeat lost"}, dg.DagsterRunStatus.STARTED,
     Outcome.KILLED_BY_SIGNAL, Outcome.HEARTBEAT_LOST),
    # A stop for good tags the run before it ends it, even while Dagster is canceling it.
    ({TAG_NO_RESUME: "true"}, dg.DagsterRunStatus.CANCELING, Outcome.PREEMPTED,
     Outcome.STOPPED_BY_USER),
    # No action on the run: the trainer's own exit is the name.
    ({}, dg.DagsterRunStatus.STARTED, Outcome.PREEMPTED, Outcome.PREEMPTED),
    ({}, dg.DagsterRunStatus.CANCELING, Outcome.USER_CODE_ERROR, Outcome.USER_CODE_ERROR),
    ({}, dg.DagsterRunStatus.CANCELING, Outcome.SUCCESS, Outcome.SUCCESS),
])
def test_an_action_on_the_run_names_the_attempts_end_over_the_exit_it_caused_as_the_decider_does(
        instance, store, tags, status, exit_outcome, named):
    run = dagster_runs.started_run(instance, KEY, tags=tags)
    if status is not dg.DagsterRunStatus.STARTED:
        instance.report_run_canceling(run)
    if status is dg.DagsterRunStatus.CANCELED:
        instance.report_run_canceled(instance.get_run_by_id(run.run_id))
    run = instance.get_run_by_id(run.run_id)
    own = AttemptEnd(exit_outcome, KEY, 143, attempt=1, dagster_run_id=run.run_id)
    assert named_end(run, own).outcome is named  # the step's name, as it records the end
    if status is dg.DagsterRunStatus.CANCELED and exit_outcome.failed:
        # The decider, reading the same run without the step's record, names it the same.
        assert failure_of(instance, run, store).outcome is named


@pytest.mark.slow  # a process stands in for the dead run worker; MLflow's client starts one
def test_a_stop_of_a_run_whose_worker_died_ends_it_at_once_and_its_decider_records_its_end(
        instance, tmp_path):
    """No launcher is asked (nothing would answer): the run is canceled at once. No step
    lived to record the attempt's end: its decider records it where the step would have
    (the attempt_ended event, MLflow) by the name it decided, `stopped_by_user`, which
    lineage and the state read too."""
    from ckpt_assets.base.events import ATTEMPT_ENDED, partition_events
    from ckpt_assets.defs.resources import MLflowResource
    from ckpt_assets.lifecycle.stop import WORKER_GONE
    from ckpt_assets.records.lineage import lineage_report
    from tests.dagster_fixtures import made_mlflow_db

    store = dagster_runs.store_with_a_checkpoint(tmp_path, KEY, max_steps=100)
    tracking = MLflowResource(tracking_uri=made_mlflow_db(tmp_path / "mlflow.db"))
    run = _killed_cli_run(instance)
    (action,) = stop_training_run(instance, KEY, "its worker died")
    assert action.action == WORKER_GONE
    ended = instance.get_run_by_id(run.run_id)
    assert ended.status == dg.DagsterRunStatus.CANCELED and TAG_NO_RESUME in ended.tags
    for _ in range(2):  # decided twice (two sensors): recorded once
        assert due_resume(instance, ended, store, tracking=tracking) is None
    assert read_decision(store.open(), KEY, run.run_id).failure_class == "stopped_by_user"
    (end, _), = partition_events(instance, KEY, ATTEMPT_ENDED)
    assert (end["failure_class"], end["attempt"], end["dagster_run_id"]) == (
        "stopped_by_user", 1, run.run_id)
    (row,) = lineage_report(instance, store.open(), KEY)["attempts"]
    assert row["end"] == "stopped_by_user"
    assert run_state(instance, KEY).outcome == "stopped_by_user"
    client = tracking.client()
    (ml,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert ml.info.status == "KILLED"
    assert (ml.data.tags["attempt_1.failure_class"], ml.data.tags["last_failure_class"]) == (
        "stopped_by_user", "stopped_by_user")
