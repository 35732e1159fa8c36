"""What a training run's MLflow run carries besides metrics: the config as params, resume
markers, failure tags, and the registered model; against a real local MLflow sqlite store,
without training anything."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from ckpt_assets.defs.resources import MLflowResource
from ckpt_assets.mlflow.tracking import MlflowTracker, flatten_params, mlflow_run_url
from trainer.process.contract import Started


class Log:
    def __init__(self):
        self.warnings: list[str] = []

    def warning(self, msg):
        self.warnings.append(msg)

    def info(self, msg):
        pass


@pytest.fixture(scope="module")
def resource(tmp_path_factory) -> MLflowResource:
    # One database for the module: creating one costs seconds (schema migrations).
    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    return MLflowResource(tracking_uri=f"sqlite:///{db}")


def tracker(resource, run: str, experiment: str = "exp", log=None) -> MlflowTracker:
    t = MlflowTracker(resource, experiment, run, log or Log())
    assert t.start({"attempt": 1})
    return t


def _run(resource, t: MlflowTracker):
    return MlflowClient(tracking_uri=resource.resolved_tracking_uri).get_run(t.run_id)


def test_a_nested_config_flattens_to_dotted_string_params_without_nulls():
    flat = flatten_params({"optim": {"lr": 0.1, "betas": [0.9, 0.99]}, "seed": 3,
                           "task": "pkg.mod:build", "command": None, "we!rd": True})
    assert flat == {"optim.lr": "0.1", "optim.betas": "[0.9, 0.99]", "seed": "3",
                    "task": "pkg.mod:build", "we_rd": "True"}


def test_a_training_runs_experiment_opens_on_mlflows_training_view_not_the_genai_one(resource):
    t = tracker(resource, "kind", experiment="kind-exp")
    client = MlflowClient(tracking_uri=resource.resolved_tracking_uri)
    exp = client.get_experiment(_run(resource, t).info.experiment_id)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


def test_the_config_is_logged_once_and_a_resumed_attempt_skips_what_is_already_there(resource):
    cfg = {"max_steps": 40, "optim": {"lr": 0.05}, "task_args": {"hidden": 32}}
    first = tracker(resource, "params-once")
    assert first.log_config(cfg) == 3
    # The next attempt opens the same MLflow run and logs the same config again.
    second = tracker(resource, "params-once")
    assert second.run_id == first.run_id
    assert second.log_config(cfg) == 0
    params = _run(resource, second).data.params
    assert params == {"max_steps": "40", "optim.lr": "0.05", "task_args.hidden": "32"}


def test_a_param_logged_with_another_value_keeps_the_first_and_warns_without_raising(resource):
    log = Log()
    t = tracker(resource, "params-changed", log=log)
    t.log_config({"optim": {"lr": 0.05}})
    assert t.log_config({"optim": {"lr": 0.5}, "seed": 1}) == 1
    assert _run(resource, t).data.params == {"optim.lr": "0.05", "seed": "1"}
    assert any("optim.lr" in w and "immutable" in w for w in log.warnings)


def test_a_resumed_attempt_marks_its_seam_with_a_metric_at_that_step_and_tags_per_attempt(
        resource):
    t = tracker(resource, "resume-marker")
    t.on_started(Started(1, None, lineage={"dagster_run_id": "run-1"}))
    t.on_started(Started(2, 20, "file:///s/step-20", lineage={"dagster_run_id": "run-2"}))
    run = _run(resource, t)
    assert run.data.tags["attempt_1.start"] == "fresh"
    assert run.data.tags["attempt_2.start"] == "resumed"
    assert run.data.tags["attempt_2.resumed_from_step"] == "20"
    assert run.data.tags["attempt_2.resumed_from"] == "file:///s/step-20"
    assert run.data.tags["attempt_2.dagster_run_id"] == "run-2"
    hist = MlflowClient(tracking_uri=resource.resolved_tracking_uri).get_metric_history(
        t.run_id, "resumed_at_step")
    assert [(m.step, m.value) for m in hist] == [(20, 20.0)]


def test_a_failed_attempt_records_its_class_and_reason_per_attempt_and_as_the_last_failure(
        resource, tmp_path):
    t = tracker(resource, "failure-tags")
    t.on_failure(1, "killed_by_signal", "training process exited -9")
    t.on_failure(2, "user_code_error", "ValueError: boom " + "x" * 9000,
                 traceback="Traceback (most recent call last):\nValueError: boom\n")
    tags = _run(resource, t).data.tags
    assert tags["attempt_1.failure_class"] == "killed_by_signal"
    assert tags["attempt_1.failure_reason"] == "training process exited -9"
    assert tags["attempt_2.failure_class"] == tags["last_failure_class"] == "user_code_error"
    assert tags["last_failure_reason"].startswith("ValueError: boom")
    assert len(tags["last_failure_reason"]) <= 5000 and tags["last_failed_attempt"] == "2"
    client = MlflowClient(tracking_uri=resource.resolved_tracking_uri)
    path = client.download_artifacts(t.run_id, "failures/attempt_2.traceback.txt",
                                     str(tmp_path))
    assert "ValueError: boom" in open(path).read()


def test_final_models_of_an_experiments_training_runs_are_versions_of_one_registered_model(
        resource, tmp_path):
    weights = tmp_path / "model.pt"
    weights.write_bytes(b"weights")
    client = MlflowClient(tracking_uri=resource.resolved_tracking_uri,
                          registry_uri=resource.resolved_tracking_uri)
    versions = {}
    for run in ("reg-a", "reg-b"):
        t = tracker(resource, run, experiment="regexp")
        versions[run] = t.log_final_model(str(weights), {"eval_loss": 0.5}, 40, "d")
    assert versions == {"reg-a": "regexp/1", "reg-b": "regexp/2"}
    # final_model materialized again for the same training run: still its one version.
    again = tracker(resource, "reg-a", experiment="regexp")
    assert again.log_final_model(str(weights), {"eval_loss": 0.4}, 40, "again") == "regexp/1"
    mvs = client.search_model_versions("name = 'regexp'")
    assert sorted((str(mv.version), mv.tags["training_run"]) for mv in mvs) == [
        ("1", "reg-a"), ("2", "reg-b")]
    assert client.get_model_version("regexp", "1").description == "again"


def test_mlflow_errors_are_warnings_and_never_reach_training(resource):
    class Broken:
        def __getattr__(self, name):
            def fail(*a, **k):
                raise ConnectionError("tracking server down")
            return fail

    log = Log()
    t = MlflowTracker(resource, "exp", "broken", log)
    t.run_id, t.client = "some-run", Broken()
    assert t.log_config({"a": 1}) == 0
    t.on_started(Started(2, 10))
    t.on_failure(2, "storage_unavailable", "S3 down", traceback="tb")
    assert t.log_final_model("/nonexistent", {}, 1, "d") is None
    assert len(log.warnings) == 4 and all("training is not affected" in w for w in log.warnings)


def test_a_half_made_mlflow_database_is_named_with_what_to_do_and_training_goes_on(tmp_path):
    import sqlite3

    db = tmp_path / "mlflow.db"  # what an interrupted or raced creation of its tables leaves
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE _alembic_tmp_experiments (x INTEGER)")
    log = Log()
    t = MlflowTracker(MLflowResource(tracking_uri=f"sqlite:///{db}"), "exp", "r", log)
    assert t.start({"attempt": 1}) is None
    (warning,) = log.warnings
    assert "training is not affected" in warning
    assert warning.endswith(f"The MLflow database of sqlite:///{db} was left half made (two "
                            "processes created its tables at once); move it aside, and the "
                            "next run creates a new one")


def test_a_stopped_run_worker_holding_the_mlflow_lock_costs_mlflow_not_a_hung_run(
        tmp_path, monkeypatch):
    import fcntl
    import os

    import trainer.storage.file_lock as file_lock

    db = tmp_path / "mlflow.db"
    monkeypatch.setattr(file_lock, "process_state", lambda pid: "T")  # the holder: stopped
    with open(tmp_path / "mlflow.db.lock", "a") as lock:  # its own open file, as another process
        fcntl.flock(lock, fcntl.LOCK_EX)
        log = Log()
        t = MlflowTracker(MLflowResource(tracking_uri=f"sqlite:///{db}"), "exp", "r", log)
        assert t.start({"attempt": 1}) is None
    (warning,) = log.warnings
    assert "training is not affected" in warning
    assert f"LockHeldError: the MLflow database {db} is locked by process {os.getpid()}, " \
           "which is stopped" in warning


def test_an_mlflow_run_link_exists_only_for_an_http_tracking_server():
    assert mlflow_run_url("http://mlflow:5000/", "3", "abc") == (
        "http://mlflow:5000/#/experiments/3/runs/abc?workflowType=machine_learning")
    assert mlflow_run_url("sqlite:///x.db", "3", "abc") is None


def test_an_attempt_stopped_for_good_is_stopped_by_user_with_its_reason_not_preempted(
        resource, tmp_path):
    """The step's own record of the end (`_record_end`), for a run a stop tagged before its
    trainer exited 143 as on a preemption."""
    from types import SimpleNamespace

    import dagster as dg

    from ckpt_assets.attempt.messages import AttemptReport
    from ckpt_assets.base.end import AttemptEnd
    from ckpt_assets.defs.assets import _record_end
    from ckpt_assets.lifecycle.ended import named_end
    from ckpt_assets.lifecycle.stop import stop_training_run
    from tests.dagster_runs import started_run
    from trainer.base.outcomes import Outcome

    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        run = started_run(instance, "halted")
        stop_training_run(instance, "halted", "wrong lr", force=True)
        context = SimpleNamespace(instance=instance, run=run, log=Log(),
                                  log_event=lambda event: None)
        t = tracker(resource, "halted")
        proc = SimpleNamespace(interrupted=dg.DagsterExecutionInterruptedError(), returncode=143)
        ended = named_end(instance.get_run_by_id(run.run_id), AttemptEnd(
            Outcome.PREEMPTED, "halted", 143, attempt=1, signal="SIGTERM"))
        assert ended.outcome is Outcome.STOPPED_BY_USER
        with pytest.raises(dg.DagsterExecutionInterruptedError):
            _record_end(context, ended, proc, t, AttemptReport("halted", 1))
    got = _run(resource, t)
    assert got.info.status == "KILLED"
    assert got.data.tags["last_failure_class"] == "stopped_by_user"
    assert got.data.tags["attempt_1.failure_reason"] == \
        "not resumed: stopped on request (wrong lr)"


def test_the_mlflow_run_links_to_the_ui_named_for_a_tracking_store_that_is_a_file(
        resource, monkeypatch):
    from ckpt_assets.defs.resources import MLFLOW_UI_URL_ENV

    t = tracker(resource, "linked")
    assert t.run_url is None  # a sqlite store: nothing to link to
    named = MLflowResource(tracking_uri=resource.tracking_uri, ui_url="http://127.0.0.1:5000")
    linked = tracker(named, "linked")
    # The training view, not the GenAI overview a fresh browser's MLflow UI opens on.
    assert linked.run_url == (f"http://127.0.0.1:5000/#/experiments/{linked.experiment_id}"
                              f"/runs/{t.run_id}?workflowType=machine_learning")
    monkeypatch.setenv(MLFLOW_UI_URL_ENV, "http://mlflow.example:5000")
    assert tracker(resource, "linked").run_url.startswith("http://mlflow.example:5000/#/")


def test_the_loss_plot_with_its_resume_marks_is_an_artifact_of_the_mlflow_run(resource):
    from ckpt_assets.mlflow.tracking import LOSS_PLOT

    t = tracker(resource, "plotted")
    t.log_loss_plot(b"\x89PNG not really")
    t.log_loss_plot(None)  # no plot was built: nothing to log, no warning
    client = MlflowClient(tracking_uri=resource.resolved_tracking_uri)
    (artifact,) = client.list_artifacts(t.run_id, "plots")
    assert artifact.path == LOSS_PLOT
    assert t.mlflow_run.log.warnings == []


RACE_OPEN = """
import sys, time
import mlflow  # imported first, so that every process opens the database at the same moment
from ckpt_assets.defs.resources import MLflowResource
uri, at = sys.argv[1], float(sys.argv[2])
time.sleep(max(0.0, at - time.time()))
client = MLflowResource(tracking_uri=uri).client()
client.create_run(client.create_experiment(sys.argv[3]))
"""


@pytest.mark.slow
def test_run_workers_opening_a_new_mlflow_database_together_all_track_and_leave_it_whole(
        tmp_path):
    import subprocess
    import sys
    import time

    from tests.dagster_fixtures import ROOT

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    at = time.time() + 8  # after every interpreter has imported MLflow, on a busy machine
    procs = [subprocess.Popen([sys.executable, "-c", RACE_OPEN, uri, str(at), f"exp{i}"],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(4)]
    # They migrate the new database one at a time, each for many seconds on a busy machine.
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(outs)[-3000:]
    client = MlflowClient(tracking_uri=uri)
    assert {e.name for e in client.search_experiments()} >= {f"exp{i}" for i in range(4)}
