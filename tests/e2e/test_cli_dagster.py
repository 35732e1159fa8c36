"""The Dagster CLI and `python -m ckpt_assets` as CI and users run them: from the repo root,
as subprocesses, against a temporary DAGSTER_HOME holding a copy of dagster_home/dagster.yaml."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import dagster as dg
import pytest

from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import (
    DAGSTER,
    PYTHON,
    ROOT,
    cli,
    dagster_cli,
    pointer_step,
    read_heartbeat_pid,
    stop_process_group,
    training_config,
)
from tests.polling import pid_alive, wait_for
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import open_store

SELECT = "training_dataset,model_checkpoint,final_model"


def _write_config(tmp_path: Path, **overrides) -> Path:
    path = tmp_path / "train.json"
    path.write_text(json.dumps(training_config(**overrides)))
    return path


def _wait(predicate, timeout: float, what: str, interval: float = 0.1):
    return wait_for(predicate, timeout, interval, what)


@pytest.mark.slow
def test_dagster_definitions_validate_accepts_the_workspace_from_the_repo_root(dagster_home):
    proc = dagster_cli("definitions", "validate", "-w", "workspace.yaml", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "All code locations passed validation" in proc.stdout + proc.stderr


def test_the_code_location_has_the_contract_names_of_the_design():
    from ckpt_assets.definitions import defs

    repo = defs.get_repository_def()
    job = defs.resolve_job_def("train_job")
    assert {k.to_user_string() for k in repo.asset_graph.get_all_asset_keys()} == {
        "training_dataset", "model_checkpoint", "final_model"}
    assert job.executor_def.name == "in_process"
    assert job.tags["dagster/max_retries"] == "0"
    assert job.partitions_def.name == "training_runs"
    for key in ("training_dataset", "model_checkpoint", "final_model"):
        assert repo.assets_defs_by_key[dg.AssetKey(key)].code_versions_by_key[
            dg.AssetKey(key)]


@pytest.mark.slow
def test_the_cli_entry_point_answers_bad_input_with_one_line_and_exit_code_2(
        tmp_path, dagster_home, store_uri):
    proc = cli("register", "Bad/Name", "--config", str(_write_config(tmp_path)))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "lowercase letters" in proc.stderr
    proc = cli("launch", "not-registered")
    assert proc.returncode == 2 and "pass --config FILE the first time" in proc.stderr
    proc = cli("register")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "required: name, --config" in proc.stderr and "register --help" in proc.stderr
    assert not (tmp_path / "store").exists()


@pytest.mark.slow
def test_cli_register_refuses_a_typod_cwd_with_exit_2_then_takes_the_corrected_config(
        tmp_path, dagster_home, store_uri):
    # Run from the user's project, not from this checkout: relative paths are the project's.
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print('training')\n")
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"command": ["python", "train.py"], "cwd": "scr",
                                  "max_steps": 5}))

    def register() -> subprocess.CompletedProcess:
        return subprocess.run([PYTHON, "-m", "ckpt_assets", "register", "first-day",
                               "--config", "train.json"], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(ROOT)},
                              capture_output=True, text=True, timeout=300)

    proc = register()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{tmp_path / 'scr'} is not a directory" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert not (tmp_path / "store").exists()
    config.write_text(json.dumps({"command": ["python", "train.py"], "cwd": "src",
                                  "max_steps": 5}))
    proc = register()
    assert proc.returncode == 0, proc.stderr
    assert "registered: training run first-day" in proc.stdout
    on_disk = json.loads((tmp_path / "store" / "default" / "first-day" / "config.json")
                         .read_text())
    assert on_disk["cwd"] == str(tmp_path / "src")


@pytest.mark.slow
def test_dagster_asset_materialize_trains_a_partition_registered_with_the_cli(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    reg = cli("register", "cli-run", "--config", str(_write_config(tmp_path)))
    assert reg.returncode == 0, reg.stderr
    proc = dagster_cli("asset", "materialize", "--select", SELECT, "--partition", "cli-run",
                       "-m", "ckpt_assets.definitions")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    listed = cli("list", "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert row["state"] == "finished" and row["latest_step"] == 40 and row["attempts"] == 1
    instance = dg.DagsterInstance.get()
    for key in ("training_dataset", "model_checkpoint", "final_model"):
        recs = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey(key), asset_partitions=["cli-run"]),
            limit=1).records
        assert recs, f"{key} was not materialized for cli-run"


@pytest.mark.slow
def test_cli_launch_queues_one_train_job_run_per_partition_that_the_daemon_runs(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    proc = cli("launch", "queued-run", "--config", str(_write_config(tmp_path)),
               "--tag", "team=ml")
    assert proc.returncode == 0, proc.stderr
    instance = dg.DagsterInstance.get()
    (run,) = instance.get_runs()
    assert run.job_name == "train_job" and run.status == dg.DagsterRunStatus.QUEUED
    assert run.tags["dagster/partition"] == "queued-run" and run.tags["team"] == "ml"
    # The run is active: that is what the user asked for, so nothing more and no error.
    again = cli("launch", "queued-run")
    assert again.returncode == 0, again.stderr
    assert f"already has an active Dagster run: {run.run_id}" in again.stdout
    assert len(instance.get_runs()) == 1

    log = open(tmp_path / "daemon.log", "wb")
    daemon = subprocess.Popen([str(Path(DAGSTER).parent / "dagster-daemon"), "run", "-w",
                               "workspace.yaml"], cwd=ROOT, env={**os.environ,
                               "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        done = _wait(lambda: instance.get_run_by_id(run.run_id).is_finished, 420,
                     "the daemon to run the queued run", interval=0.5)
        assert done
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.SUCCESS, \
            (tmp_path / "daemon.log").read_text()[-3000:]
    finally:
        stop_process_group(daemon)
        log.close()
    listed = json.loads(cli("list", "--json").stdout)
    assert listed[0]["state"] == "finished" and listed[0]["latest_step"] == 40


def _start_materialize(tmp_path, name: str, **overrides) -> subprocess.Popen:
    from ckpt_assets.cli.main import main as cli_main

    assert cli_main(["register", name, "--config", str(_write_config(tmp_path, **overrides))]) == 0
    return subprocess.Popen(
        [DAGSTER, "asset", "materialize", "--select", SELECT, "--partition", name,
         "-m", "ckpt_assets.definitions"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=open(tmp_path / "materialize.log", "wb"), stderr=subprocess.STDOUT)


# Held after step 12 (a checkpoint at 10 committed) until the signal comes: no clock to race.
SLOW_RUN = {"max_steps": 2000, "task_args": {"pause_after_step": 12}}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_the_run_stops_the_trainer_which_commits_before_it_exits(
        tmp_path, dagster_home, store_uri, mlflow_uri, sig):
    store = Path(store_uri)
    proc = _start_materialize(tmp_path, "stopped", **SLOW_RUN)
    try:
        _wait(lambda: (pointer_step(store, "default", "stopped") or 0) >= 10, 300,
              "a committed checkpoint")
        trainer_pid = read_heartbeat_pid(store, "default", "stopped")
        proc.send_signal(sig)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            raise AssertionError("the run did not end after the signal:\n" + (
                tmp_path / "materialize.log").read_text()[-6000:]) from None
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1  # `dagster asset materialize`: "Materialization failed."
    _wait(lambda: not pid_alive(trainer_pid), 30, "the trainer to exit")
    repo = CheckpointRepo(open_store(store_uri), "default", "stopped")
    m = repo.read_manifest(repo.read_pointer().checkpoint)
    assert m.meta["reason"] == "preempted"  # the trainer's SIGTERM path committed this one
    assert m.step > 10  # past the periodic one: where it was stopped (held before 13, or
    #                     earlier if the signal came first on a busy machine)
    instance = dg.DagsterInstance.get()
    (run,) = instance.get_runs()
    observed = [e.dagster_event.asset_observation_data.asset_observation.metadata for e in
                instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_OBSERVATION)]
    ended = [md for md in observed if md["event"].value == "attempt_ended"]
    assert [md["exit_code"].value for md in ended] == [143]
    assert ended[0]["failure_class"].value == "preempted"
    assert ended[0]["last_committed_step"].value == m.step
    # A signal to the run's own process is not a termination requested through Dagster (the
    # run never went CANCELING), so Dagster ends it as an unexpected interruption: FAILURE.
    assert run.status == dg.DagsterRunStatus.FAILURE


@pytest.mark.slow
def test_a_sigkilled_run_process_takes_its_trainer_down_after_a_final_commit(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    store = Path(store_uri)
    proc = _start_materialize(tmp_path, "orphan", **SLOW_RUN)
    try:
        _wait(lambda: (pointer_step(store, "default", "orphan") or 0) >= 10, 300,
              "a committed checkpoint")
        trainer_pid = read_heartbeat_pid(store, "default", "orphan")
        proc.kill()  # SIGKILL: no handler runs in the orchestrator
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # PR_SET_PDEATHSIG delivers SIGTERM to the trainer; it commits and exits 143.
    _wait(lambda: not pid_alive(trainer_pid), 30, "the orphaned trainer to exit")
    repo = CheckpointRepo(open_store(store_uri), "default", "orphan")
    m = repo.read_manifest(repo.read_pointer().checkpoint)
    # Committed by the trainer's SIGTERM path, past the periodic checkpoint at 10: where it
    # was stopped (held before 13, or earlier if the signal came first on a busy machine).
    assert m.meta["reason"] == "preempted" and m.step > 10


@pytest.mark.slow
def test_cli_stop_cancels_a_queued_run_and_marks_it_not_to_be_resumed(
        tmp_path, dagster_home, store_uri, capsys):
    from ckpt_assets.cli.main import main as cli_main

    assert cli_main(["launch", "to-stop", "--config", str(_write_config(tmp_path))]) == 0
    instance = dg.DagsterInstance.get()
    (run,) = instance.get_runs()
    assert run.status == dg.DagsterRunStatus.QUEUED
    assert cli_main(["stop", "to-stop"]) == 0
    run = instance.get_run_by_id(run.run_id)
    assert run.status == dg.DagsterRunStatus.CANCELED
    assert run.tags["ckpt/no_resume"] == "true"
    capsys.readouterr()
    assert cli_main(["stop", "to-stop"]) == 2
    assert "has no queued or running Dagster run" in capsys.readouterr().err
