"""What a user sees of a training run where Dagster users look: the partition's state as a
check (a run stopped for good apart from one never launched), a resumed run apart from an
uninterrupted one, a preemption that reads as one, the history on the final model, a new
run started from the launchpad, and a stop's reason in the decision and the lineage.

Fast: run records in a temporary instance, assets and jobs executed in process; nothing
trains (tests/e2e/test_browser.py reads the same in the UI, after real runs)."""

from __future__ import annotations

import dagster as dg
import pytest
from dagster._core.storage.event_log.base import PartitionKeyFilter

from ckpt_assets.attempt.messages import attempt_failure, failure_description
from ckpt_assets.base.end import AttemptEnd
from ckpt_assets.base.events import MODEL_CHECKPOINT_KEY, STATE, partition_events
from ckpt_assets.base.queries import newest_training_run
from ckpt_assets.base.registration import read_registration, register_training_run
from ckpt_assets.base.tags import (
    PARTITION_TAG,
    TAG_ATTEMPT,
    TAG_NEW_RUN_TARGET,
    TAG_PARENT_RUN_ID,
    TAG_RESUME_FROM,
)
from ckpt_assets.defs.jobs import new_training_run_job
from ckpt_assets.defs.resources import CheckpointStore
from ckpt_assets.lifecycle.decision import due_resume
from ckpt_assets.lifecycle.state import STATE_CHECK, State, run_state
from ckpt_assets.lifecycle.stop import stop_request, stop_training_run
from ckpt_assets.records.history import history_frame, loss_history
from ckpt_assets.records.lineage import format_lineage, lineage_report
from tests import dagster_runs
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import NO_COMPUTE_LOGS, instance_in
from trainer.base.outcomes import Outcome
from trainer.checkpoints.records import CheckpointRecord, Lineage

KEY = "seen"
S = dg.DagsterRunStatus
CHECK_KEY = dg.AssetCheckKey(MODEL_CHECKPOINT_KEY, STATE_CHECK)


@pytest.fixture
def instance():
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def state_checks(instance, partition: str = KEY) -> list[dg.AssetCheckEvaluation]:
    """The partition's training_run_state evaluations, newest first."""
    records = instance.event_log_storage.get_asset_check_execution_history(
        CHECK_KEY, limit=20, partition_filter=PartitionKeyFilter(key=partition))
    return [r.event.dagster_event.event_specific_data for r in records]


def _check(instance, partition: str, tmp_path) -> dg.AssetCheckEvaluation:
    """The state check as check_training_run evaluates it (the partition is the run's tag)."""
    from ckpt_assets.definitions import defs, make_resources

    result = defs.resolve_job_def("check_training_run").execute_in_process(
        instance=instance, tags={PARTITION_TAG: partition}, raise_on_error=False,
        resources=make_resources(str(tmp_path / "store")))
    (evaluation,) = [e for e in result.get_asset_check_evaluations()
                     if e.check_name == STATE_CHECK]
    return evaluation


# -- 11: the state where Dagster users look --------------------------------------------------

def test_a_run_stopped_for_good_fails_its_state_check_with_the_reason_and_a_new_one_has_none(
        instance, checkpoint_store):
    dagster_runs.lost_worker_run(instance, KEY)  # ended, its resume still to be decided
    stop_training_run(instance, KEY, "wrong lr")
    run = newest_training_run(instance, KEY)
    assert due_resume(instance, run, checkpoint_store) is None
    latest = state_checks(instance)[0]
    assert not latest.passed and latest.severity == dg.AssetCheckSeverity.WARN
    assert latest.description == "stopped by user: stopped on request (wrong lr)"
    assert latest.metadata["state"].value == State.STOPPED_BY_USER.value
    # A partition never launched has no evaluation at all: "Missing", not "stopped".
    assert state_checks(instance, "never-launched") == []


def test_a_run_the_policy_stopped_fails_its_state_check_as_an_error(instance, tmp_path):
    from ckpt_assets.base.tags import TAG_DECISION, TAG_DECISION_REASON

    dagster_runs.run_in_status(instance, KEY, S.FAILURE, {
        TAG_DECISION: "stop", TAG_DECISION_REASON: "not resumed: a bug in user code"})
    evaluation = _check(instance, KEY, tmp_path)
    assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.ERROR
    assert evaluation.description == "stopped by policy: not resumed: a bug in user code"


def test_a_resumed_run_finishes_saying_so_and_an_uninterrupted_one_does_not(instance,
                                                                            tmp_path):
    dagster_runs.run_in_status(instance, KEY, S.SUCCESS)
    assert run_state(instance, KEY).detail == "attempt 1 finished the run"
    dagster_runs.run_in_status(instance, "resumed", S.SUCCESS, {
        TAG_PARENT_RUN_ID: "f" * 36, TAG_ATTEMPT: "2", TAG_RESUME_FROM: "file:///s/step-20"})
    assert run_state(instance, "resumed").detail == (
        "attempt 2 finished the run, after 1 interrupted attempt(s): it resumed from "
        "file:///s/step-20")
    # The check the sensor launches after a success reads it, and passes.
    evaluation = _check(instance, "resumed", tmp_path)
    assert evaluation.passed and "1 interrupted attempt" in evaluation.description


def _checkpoint(step: int, attempt: int, resumed_from: int | None) -> CheckpointRecord:
    return CheckpointRecord(
        step=step, uri=f"file:///s/step-{step}", name=f"step-{step:09d}-a{attempt}",
        sha256="0" * 64, size=100, attempt=attempt, loss=1.0 / step,
        lineage=Lineage(experiment="default", run=KEY, attempt=attempt,
                        resumed_from_step=resumed_from))


def test_the_history_on_the_final_outputs_names_where_the_run_resumed(instance):
    reported = [_checkpoint(10, 1, None), _checkpoint(20, 1, None), _checkpoint(30, 2, 20)]
    history = loss_history(instance, KEY, reported)
    assert history.metadata["resumes"] == "attempt 2 from step 20"
    assert history.png.startswith(b"\x89PNG")
    assert len(history.metadata["metrics_history"].value.records) == 3
    assert loss_history(instance, KEY, reported[:2]).metadata["resumes"] == "none"
    assert history_frame(instance, KEY, reported)["resumed"].tolist() == [False, False, True]


# -- 12: a preemption reads as one ------------------------------------------------------------

PREEMPTED = AttemptEnd(Outcome.PREEMPTED, KEY, 143, attempt=1, last_committed_step=23,
                       checkpoint_uri="file:///s/step-23", signal="SIGTERM")


def test_a_preempted_step_fails_with_one_line_naming_the_preemption_and_its_resume(instance):
    from ckpt_assets.attempt.messages import AttemptReport
    from ckpt_assets.lifecycle.ended import recorded_end

    @dg.asset(name="model_checkpoint")
    def preempted():
        raise attempt_failure(PREEMPTED, AttemptReport(KEY, 1))

    result = dg.materialize([preempted], instance=instance, raise_on_error=False)
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    ufd = failure.step_failure_data.user_failure_data
    assert ufd.description == (
        "preempted, not a bug: the training process exited 143 (SIGTERM) in attempt 1 of "
        f"training run {KEY}: stopped by SIGTERM/SIGINT after committing a checkpoint (or "
        "killed by one); last committed step 23 (file:///s/step-23). To be resumed at once, "
        "within the preemption budget by the resume sensors")
    assert "\n" not in ufd.description
    assert ufd.metadata["resumed"].value == "at once, within the preemption budget"
    # The resume sensors read the same record back: the classification is unchanged.
    run = instance.get_run_by_id(result.run_id)
    assert recorded_end(instance, run).outcome is Outcome.PREEMPTED


def test_a_bug_keeps_its_plain_description_and_no_failure_is_retried_by_dagster():
    from ckpt_assets.attempt.messages import AttemptReport

    bug = AttemptEnd(Outcome.USER_CODE_ERROR, KEY, 1, attempt=2, last_committed_step=10)
    assert failure_description(bug).startswith("training process exited 1 (user_code_error)")
    for ended in (bug, PREEMPTED):
        assert attempt_failure(ended, AttemptReport(KEY, 1)).allow_retries is False


# -- 14: a new run from the launchpad ---------------------------------------------------------

@pytest.fixture
def queue_instance(dagster_home):
    """The project's instance: the run queue (a launched run waits; nothing trains), and no
    compute log capture."""
    with instance_in(dagster_home, NO_COMPUTE_LOGS) as inst:
        assert isinstance(inst.run_coordinator, dg.QueuedRunCoordinator)
        yield inst


def _new_run(instance, name: str, store: str, **training) -> dg.ExecuteInJobResult:
    return new_training_run_job.execute_in_process(
        instance=instance, raise_on_error=False,
        resources={"checkpoint_store": CheckpointStore(uri=store)},
        run_config={"ops": {"new_training_run_op": {"config": {
            "name": name, "training": {"max_steps": 7, **training}}}}})


def _train_job_runs(instance, name: str) -> list[dg.DagsterRun]:
    return instance.get_runs(filters=dg.RunsFilter(job_name="train_job",
                                                   tags={PARTITION_TAG: name}))


def test_the_launchpad_job_registers_a_new_run_by_name_and_queues_its_train_job(
        queue_instance, tmp_path):
    store = str(tmp_path / "store")
    result = _new_run(queue_instance, "from-launchpad", store)
    assert result.success
    reg = read_registration(CheckpointStore(uri=store).open(), "from-launchpad")
    assert reg is not None and reg.config.max_steps == 7
    (queued,) = _train_job_runs(queue_instance, "from-launchpad")
    assert queued.status == S.QUEUED
    (output,) = [e for e in result.all_events if e.event_type_value == "STEP_OUTPUT"]
    assert output.step_output_data.metadata["train_job_run"].value == queued.run_id
    assert queue_instance.get_run_by_id(result.run_id).tags[TAG_NEW_RUN_TARGET] == \
        "from-launchpad"
    # Launched again: the active run is named, nothing else is queued.
    assert _new_run(queue_instance, "from-launchpad", store).success
    assert len(_train_job_runs(queue_instance, "from-launchpad")) == 1


def test_a_bad_name_from_the_launchpad_fails_in_one_line_and_registers_nothing(
        queue_instance, tmp_path):
    result = _new_run(queue_instance, "Bad Name", str(tmp_path / "store"))
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    description = failure.step_failure_data.user_failure_data.description
    assert "Bad Name" in description and "\n" not in description
    assert not queue_instance.get_runs(filters=dg.RunsFilter(job_name="train_job"))
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.json"))


def test_a_value_outside_its_range_from_the_launchpad_fails_naming_the_key_and_registers_nothing(
        queue_instance, tmp_path):
    # Dagster 1.13's config schema has no numeric ranges: the form shows each key's range in
    # its help and says "No errors" for max_steps -5; Launch then refuses it here, in one
    # line that names the key, before anything is registered or queued.
    result = _new_run(queue_instance, "out-of-range", str(tmp_path / "store"), max_steps=-5)
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    description = failure.step_failure_data.user_failure_data.description
    assert "max_steps" in description and "\n" not in description, description
    assert not queue_instance.get_runs(filters=dg.RunsFilter(job_name="train_job"))
    assert read_registration(CheckpointStore(uri=str(tmp_path / "store")).open(),
                             "out-of-range") is None


# -- 15: a stop's reason in the decision and the lineage --------------------------------------

def test_a_stops_reason_is_in_the_decision_event_the_state_and_the_lineage(instance, tmp_path):
    source = CheckpointStore(uri=str(tmp_path / "store"))
    store = source.open()
    register_training_run(store, KEY, {"max_steps": 100})
    run = dagster_runs.started_run(instance, KEY)
    assert stop_request(instance, run.run_id) is None
    stop_training_run(instance, KEY, "wrong lr", force=True)
    assert stop_request(instance, run.run_id) == "not resumed: stopped on request (wrong lr)"
    assert due_resume(instance, instance.get_run_by_id(run.run_id), source) is None
    words = [e.message for e in instance.all_logs(
        run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)]
    assert "Not resumed (stopped_by_user): stopped on request (wrong lr)" in words
    decided = [md for md, _ in partition_events(instance, KEY, STATE) if md.get("decision")]
    assert decided[-1]["reason"] == "not resumed: stopped on request (wrong lr)"
    text = format_lineage(lineage_report(instance, store, KEY))
    assert "      not resumed: stopped on request (wrong lr)" in text.splitlines()
