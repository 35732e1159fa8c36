"""The asset checks run in their own job, once per succeeded training run, on its partition.

Training runs are interrupted routinely (a preemption fails the Dagster run; a resume
follows as a new run), so the training jobs plan no asset checks: an interrupted attempt
leaves no "execution failed" check evaluation. `check_succeeded_training` launches
`check_training_run` for the partition of every training run that succeeds. The sensor's
decisions are evaluated through Dagster's run-status sensor context, on real run records
of an ephemeral instance; its RunRequests are executed in-process as the daemon would
launch them.
"""

from __future__ import annotations

import signal

import dagster as dg
import pytest
from dagster._core.event_api import PartitionKeyFilter
from dagster._core.test_utils import create_run_for_test

from ckpt_assets.base.names import PARTITIONS_NAME
from ckpt_assets.base.tags import PARTITION_TAG, TAG_CHECKED_RUN
from ckpt_assets.definitions import defs, make_resources
from ckpt_assets.defs.check_runs import check_succeeded_training
from ckpt_assets.defs.checks import TRAINING_CHECKS
from ckpt_assets.defs.partitions import training_runs
from ckpt_assets.defs.resources import CheckpointStore
from ckpt_assets.lifecycle.settings import Setting
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import TrainerKiller, step_failure_metadata, training_config
from tests.dagster_runs import store_with_a_checkpoint

KEY = "run-a"
CHECK_KEYS = [key for checks in TRAINING_CHECKS for key in checks.check_keys]
CHECK_EVENTS = (dg.DagsterEventType.ASSET_CHECK_EVALUATION_PLANNED,
                dg.DagsterEventType.ASSET_CHECK_EVALUATION)


# -- runs and sensor evaluations --------------------------------------------------------------

def succeeded_run(instance, job_name: str = "train_job", partition: str = KEY) -> dg.DagsterRun:
    """A run of a job called `job_name` for `partition` that succeeded."""

    @dg.op(name="model_checkpoint")
    def model_checkpoint():
        pass

    @dg.job(name=job_name)
    def job():
        model_checkpoint()

    return job.execute_in_process(instance=instance, raise_on_error=False,
                                  tags={PARTITION_TAG: partition}).dagster_run


def on_success(instance, run: dg.DagsterRun):
    """One evaluation of check_succeeded_training on `run`'s success, as the daemon makes it."""
    (end,) = instance.all_logs(run.run_id, of_type=dg.DagsterEventType.RUN_SUCCESS)
    return check_succeeded_training(dg.build_run_status_sensor_context(
        sensor_name=check_succeeded_training.name, dagster_event=end.dagster_event,
        dagster_instance=instance, dagster_run=instance.get_run_by_id(run.run_id)))


def launch(instance, req: dg.RunRequest, resources: dict) -> dg.ExecuteInProcessResult:
    """The run the daemon makes of a RunRequest, executed in this process."""
    job = defs.resolve_job_def(req.job_name)
    if req.asset_check_keys is not None:
        job = job.get_subset(asset_check_selection=set(req.asset_check_keys))
    return job.execute_in_process(instance=instance, resources=resources,
                                  run_config=req.run_config or None, raise_on_error=False,
                                  tags={**req.tags, "dagster/run_key": req.run_key})


def check_history(instance, partition: str | None = None) -> dict[str, list]:
    """Every recorded execution (planned, passed or failed) of each check, newest first."""
    flt = PartitionKeyFilter(key=partition) if partition else None
    return {key.name: instance.event_log_storage.get_asset_check_execution_history(
        key, limit=100, partition_filter=flt) for key in CHECK_KEYS}


def check_events(instance, run_id: str) -> list:
    return [rec for kind in CHECK_EVENTS for rec in instance.all_logs(run_id, of_type=kind)]


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    """KEY registered, with one committed checkpoint (step 20, loss 0.5) and no final model."""
    return store_with_a_checkpoint(tmp_path, KEY, 20, {"loss": 0.5})


# -- the jobs ---------------------------------------------------------------------------------

def test_the_training_jobs_plan_no_checks_and_the_check_job_runs_only_the_partitioned_checks():
    for name in ("train_job", "train_demo"):
        job = defs.resolve_job_def(name)
        assert job.asset_layer.asset_graph.asset_check_keys == set(), name
        assert "ckpt/job" not in job.tags
    checks = defs.resolve_job_def("check_training_run")
    assert checks.asset_layer.asset_graph.asset_check_keys == set(CHECK_KEYS)
    assert not checks.asset_layer.asset_graph.executable_asset_keys
    assert all(spec.partitions_def == training_runs
               for c in TRAINING_CHECKS for spec in c.check_specs)
    assert "ckpt/job" not in defs.resolve_job_def("stop_training_run").tags


def test_a_failed_training_run_plans_and_records_no_check_evaluation(instance, tmp_path):
    # The real train_job, failing at its first step (the partition has no registered config).
    instance.add_dynamic_partitions(PARTITIONS_NAME, [KEY])
    result = defs.resolve_job_def("train_job").execute_in_process(
        instance=instance, partition_key=KEY, raise_on_error=False,
        resources=make_resources(str(tmp_path / "store"),
                                 tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"))
    assert result.dagster_run.status == dg.DagsterRunStatus.FAILURE
    assert check_events(instance, result.run_id) == []
    assert check_history(instance) == {key.name: [] for key in CHECK_KEYS}


# -- the sensor's decisions -------------------------------------------------------------------

@pytest.mark.parametrize("job_name", ["train_job", "train_demo"])
def test_a_succeeded_training_run_requests_one_check_run_for_its_partition_keyed_by_its_run_id(
        instance, job_name):
    run = succeeded_run(instance, job_name)
    req = on_success(instance, run)
    assert isinstance(req, dg.RunRequest)
    assert req.job_name == "check_training_run" and req.partition_key == KEY
    assert req.run_key == f"checks-{run.run_id}"
    assert req.tags == {PARTITION_TAG: KEY, TAG_CHECKED_RUN: run.run_id}
    assert req.asset_check_keys is None  # all three checks
    # Evaluated again (a retried tick): the same run_key, so the daemon launches it once.
    assert on_success(instance, run).run_key == req.run_key


@pytest.mark.parametrize("job_name", ["stop_training_run", "check_training_run"])
def test_the_success_of_a_run_that_is_not_a_training_run_launches_no_checks(instance, job_name):
    # check_training_run included: a check run's own success must not launch another one.
    assert isinstance(on_success(instance, succeeded_run(instance, job_name)), dg.SkipReason)


def test_a_training_run_superseded_by_a_newer_training_run_of_its_partition_launches_no_checks(
        instance):
    run = succeeded_run(instance)
    create_run_for_test(instance, job_name="check_training_run", tags={PARTITION_TAG: KEY})
    create_run_for_test(instance, job_name="train_job", tags={PARTITION_TAG: "other-run"})
    assert isinstance(on_success(instance, run), dg.RunRequest)  # neither is newer training
    newer = create_run_for_test(instance, job_name="train_job", tags={PARTITION_TAG: KEY})
    skip = on_success(instance, run)
    assert isinstance(skip, dg.SkipReason) and newer.run_id[:8] in skip.skip_message


@pytest.mark.filterwarnings("ignore:.*partitions_def on an AssetCheckSpec:dagster.PreviewWarning")
def test_a_training_run_that_evaluated_some_checks_itself_gets_only_the_others_run(instance):
    # A run of the assets together with model_checkpoint's checks (as the UI's Materialize
    # may launch it): only final_model's check and the state check are left to run.
    @dg.asset(name="model_checkpoint", partitions_def=training_runs)
    def model_checkpoint() -> None: ...

    @dg.asset(name="final_model", partitions_def=training_runs, deps=[model_checkpoint])
    def final_model() -> None: ...

    def passing(name):
        @dg.asset_check(asset=model_checkpoint, name=name, partitions_def=training_runs)
        def check() -> dg.AssetCheckResult:
            return dg.AssetCheckResult(passed=True)
        return check

    job = dg.Definitions(
        assets=[model_checkpoint, final_model],
        asset_checks=[passing("latest_checkpoint_verifies"),
                      passing("latest_checkpoint_loss_is_finite")],
        jobs=[dg.define_asset_job("train_job")]).resolve_job_def("train_job")
    instance.add_dynamic_partitions(PARTITIONS_NAME, [KEY])
    run = job.execute_in_process(instance=instance, partition_key=KEY).dagster_run
    req = on_success(instance, run)
    assert sorted(k.name for k in req.asset_check_keys) == [
        "final_model_meets_eval_loss_threshold", "training_run_state"]


# -- what the check run records ---------------------------------------------------------------

def test_a_check_run_evaluates_each_check_on_the_partition_of_the_training_run(instance, store):
    req = on_success(instance, succeeded_run(instance))
    checked = launch(instance, req, make_resources(store=store))
    assert checked.success
    on_partition = check_history(instance, KEY)
    assert {name: [(r.status.value, r.partition, r.run_id) for r in recs]
            for name, recs in on_partition.items()} == {
        "latest_checkpoint_verifies": [("SUCCEEDED", KEY, checked.run_id)],
        "latest_checkpoint_loss_is_finite": [("SUCCEEDED", KEY, checked.run_id)],
        # No final model was stored: a failed check on this partition, saying so.
        "final_model_meets_eval_loss_threshold": [("FAILED", KEY, checked.run_id)],
        "training_run_state": [("SUCCEEDED", KEY, checked.run_id)]}
    assert on_partition["final_model_meets_eval_loss_threshold"][0].evaluation.description
    assert all(r.partition == KEY for recs in check_history(instance).values() for r in recs)
    assert check_history(instance, "other-run") == {key.name: [] for key in CHECK_KEYS}


@pytest.mark.slow
def test_an_interrupted_attempt_leaves_no_check_evaluation_and_its_resume_gets_passing_checks(
        instance, tmp_path, mlflow_uri, monkeypatch):
    # The sensor path: a preempted attempt fails its run, and the resume is a new run (with
    # in-run relaunch on, a trainer SIGTERMed alone trains on in the same run).
    monkeypatch.setenv(Setting.IN_RUN_RELAUNCH, "0")
    store_dir = tmp_path / "store"
    resources = make_resources(str(store_dir), tracking_uri=mlflow_uri)
    train = defs.resolve_job_def("train_job")
    instance.add_dynamic_partitions(PARTITIONS_NAME, [KEY])
    # A preemption: SIGTERM to the real trainer once a checkpoint is committed (exit 143).
    killer = TrainerKiller(store_dir, "default", KEY, at_step=10, sig=signal.SIGTERM)
    killer.start()
    cfg = training_config(task_args={"step_delay": 0.05})
    first = train.execute_in_process(
        instance=instance, partition_key=KEY, resources=resources, raise_on_error=False,
        run_config={"ops": {"training_dataset": {"config": {"training": cfg}}}})
    killer.cancel()
    assert killer.killed_pid and first.dagster_run.status == dg.DagsterRunStatus.FAILURE
    assert step_failure_metadata(first)[1]["exit_code"] == 143
    assert check_events(instance, first.run_id) == []
    assert check_history(instance) == {key.name: [] for key in CHECK_KEYS}
    # The resume (the registered config, from the latest checkpoint) succeeds; its success
    # launches the checks, which pass, once each, on the partition.
    resumed = train.execute_in_process(instance=instance, partition_key=KEY,
                                       resources=resources)
    assert resumed.success and check_events(instance, resumed.run_id) == []
    checked = launch(instance, on_success(instance, resumed.dagster_run), resources)
    assert checked.success
    assert {name: [(r.status.value, r.partition, r.run_id) for r in recs]
            for name, recs in check_history(instance).items()} == {
        key.name: [("SUCCEEDED", KEY, checked.run_id)] for key in CHECK_KEYS}
