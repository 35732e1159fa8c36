"""A training run's life through real processes: a stop for good is `stopped_by_user` in
every place a user looks, and a `ckpt-assets run` killed by SIGKILL is followed by a re-run
linked as its child."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import dagster as dg
import pytest

from ckpt_assets.base.view import RunView
from ckpt_assets.defs.resources import CheckpointStore
from ckpt_assets.lifecycle.decision import due_resume
from ckpt_assets.lifecycle.stop import stop_training_run
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import (
    DAGSTER,
    NO_MLFLOW,
    PYTHON,
    ROOT,
    cli,
    pointer_step,
    read_heartbeat_pid,
    training_config,
)
from tests.outcome_views import outcome_names
from tests.polling import pid_alive, wait_for
from trainer.base.outcomes import Outcome

SLOW_RUN = {"max_steps": 2000, "task_args": {"step_delay": 0.02}}


def _config(tmp_path: Path, name: str, **overrides) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(training_config(**overrides)))
    return path


def _wait_committed(store_uri: str, name: str, step: int) -> None:
    wait_for(lambda: (pointer_step(Path(store_uri), "default", name) or 0) >= step, 300,
             what=f"a checkpoint of {name} at step {step} or later")


@pytest.mark.slow
def test_a_stop_for_good_reads_stopped_by_user_in_all_six_views(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    from ckpt_assets.cli.main import main as cli_main

    name = "halted"
    assert cli_main(["register", name, "--config", str(_config(tmp_path, name, **SLOW_RUN))]) == 0
    log = open(tmp_path / "materialize.log", "wb")
    proc = subprocess.Popen(
        [DAGSTER, "asset", "materialize", "--select",
         "training_dataset,model_checkpoint,final_model", "--partition", name,
         "-m", "ckpt_assets.definitions"], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_committed(store_uri, name, 10)
        trainer = read_heartbeat_pid(Path(store_uri), "default", name)
        # The stop tags the run first; this run's process is the terminal's own, so its
        # termination is delivered as the terminal would: SIGTERM to the run's process.
        stop_training_run(dg.DagsterInstance.get(), name, "wrong lr")
        proc.send_signal(signal.SIGTERM)
        proc.wait(180)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    wait_for(lambda: not pid_alive(trainer), 60, what="the trainer to exit")
    instance = dg.DagsterInstance.get()
    (run,) = instance.get_runs()
    ended = [e.dagster_event.asset_observation_data.asset_observation.metadata for e in
             instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_OBSERVATION)]
    ended = [md for md in ended if md["event"].value == "attempt_ended"]
    assert [md["exit_code"].value for md in ended] == [143]  # it exits as on a preemption
    assert due_resume(instance, run, CheckpointStore(uri=store_uri)) is None  # never resumed
    view = RunView.of(instance.get_run_by_id(run.run_id))
    assert (view.decision, view.failure_kind) == ("stop", "stopped_by_user")
    names = outcome_names(instance, store_uri, mlflow_uri, name, run.run_id, attempt=1)
    assert set(names.values()) == {"stopped_by_user"}, names
    (row,) = json.loads(cli("list", "--json").stdout)
    assert (row["state"], row["outcome"]) == ("stopped by user", "stopped_by_user")


def _ci_run(tmp_path: Path, name: str, config: Path) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "-m", "ckpt_assets", "run", name, "--config", str(config)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=open(tmp_path / f"{name}.log", "ab"),
                            stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_a_rerun_after_a_sigkilled_ckpt_assets_run_is_linked_as_the_killed_runs_child(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    name = "killed-ci"
    config = _config(tmp_path, name, max_steps=120, task_args={"step_delay": 0.02})
    proc = _ci_run(tmp_path, name, config)
    try:
        _wait_committed(store_uri, name, 10)
        trainer = read_heartbeat_pid(Path(store_uri), "default", name)
        proc.kill()  # SIGKILL: its run (executed in this process) still reads STARTED
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for(lambda: not pid_alive(trainer), 60, what="the orphaned trainer to exit")
    again = _ci_run(tmp_path, name, config)
    try:
        code = again.wait(600)
    finally:
        if again.poll() is None:
            again.kill()
    assert code == 0, (tmp_path / f"{name}.log").read_text()[-6000:]
    first, second = json.loads(cli("lineage", name, "--json").stdout)["attempts"]
    assert second["parent_run_id"] == first["dagster_run_id"]
    assert second["root_run_id"] == first["dagster_run_id"]
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert first["end"] == "worker_lost"
    (row,) = json.loads(cli("list", "--json").stdout)
    assert (row["state"], row["attempt"]) == ("finished", 2)


@pytest.mark.slow
def test_a_finished_run_run_again_or_launched_by_hand_trains_nothing_and_exits_0(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    name = "done-once"
    config = _config(tmp_path, name, max_steps=10)
    first = _ci_run(tmp_path, name, config)
    assert first.wait(600) == 0, (tmp_path / f"{name}.log").read_text()[-6000:]
    for verb in ("run", "launch"):
        again = subprocess.run([PYTHON, "-m", "ckpt_assets", verb, name], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                               text=True, timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"training run {name} already finished" in again.stdout, verb
        assert len(dg.DagsterInstance.get().get_runs()) == 1, verb  # nothing launched


@pytest.mark.slow
def test_a_ckpt_assets_run_whose_command_commits_nothing_exits_non_zero_naming_it(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    # The script exits 0 having committed nothing: a CI job that runs it must go red.
    (tmp_path / "noop.py").write_text("print('trained nothing')\n")
    config = tmp_path / "noop.json"
    config.write_text(json.dumps({"command": ["python", "noop.py"], "cwd": str(tmp_path)}))
    proc = subprocess.run([PYTHON, "-m", "ckpt_assets", "run", "noop", "--config", str(config)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == Outcome.NO_CHECKPOINT.exit_code, proc.stdout + proc.stderr
    assert "no_checkpoint" in proc.stdout and "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_preempted_ckpt_assets_run_prints_a_short_summary_and_run_again_resumes_as_its_child(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    name = "told"
    config = _config(tmp_path, name, max_steps=150, task_args={"step_delay": 0.02})
    proc = subprocess.Popen([PYTHON, "-m", "ckpt_assets", "run", name, "--config", str(config)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_committed(store_uri, name, 10)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]  # the attempt's outcome: preempted
    lines = out.strip().splitlines()
    assert "Traceback" not in out + err and "DEBUG" not in out + err, (out, err)
    assert len(lines) <= 4, out  # the start, the summary and what comes next
    assert "ended preempted (exit 143); last committed step" in out
    assert f"no daemon runs here: run `ckpt-assets run {name}` again" in out
    assert "resume sensors" not in out  # no promise of sensors where none run
    log = Path(dagster_home) / "logs" / f"run-{name}.log"
    # What the terminal no longer shows is in the log file, stack traces included.
    logged = log.read_text()
    assert "DEBUG" in logged and "DagsterExecutionInterruptedError" in logged
    interrupted_at = pointer_step(Path(store_uri), "default", name)
    assert interrupted_at is not None and 10 <= interrupted_at < 150

    # Run again, as the summary says: it resumes from that checkpoint as the run's child.
    again = _ci_run(tmp_path, name, config)
    try:
        assert again.wait(600) == 0, (tmp_path / f"{name}.log").read_text()[-6000:]
    finally:
        if again.poll() is None:
            again.kill()
    first, second = json.loads(cli("lineage", name, "--json").stdout)["attempts"]
    assert (first["attempt"], second["attempt"]) == (1, 2)
    assert second["parent_run_id"] == first["dagster_run_id"]
    assert second["root_run_id"] == first["dagster_run_id"] == first["root_run_id"]
    assert first["failure_class"] == "preempted"
    assert second["resumed_from_step"] == interrupted_at
    (row,) = json.loads(cli("list", "--json").stdout)
    assert (row["state"], row["attempt"]) == ("finished", 2)


@pytest.mark.slow
def test_a_trainer_relaunched_in_its_run_is_not_declared_dead_before_its_first_beat(
        tmp_path, dagster_home, store_uri, mlflow_uri, monkeypatch):
    """The relaunched trainer's start-up (its task's build, before its first beat) lasts
    several heartbeat timeouts, as on a loaded machine; the reconciler sweeps meanwhile."""
    from ckpt_assets.base.tags import TAG_HEARTBEAT_LOST
    from ckpt_assets.defs.sensors import reconcile_training_runs
    from ckpt_assets.lifecycle.settings import Setting

    timeout_s = 3.0
    monkeypatch.setenv(Setting.HEARTBEAT_TIMEOUT_S.value, str(timeout_s))
    monkeypatch.setenv(Setting.WORKER_GRACE_S.value, "600")  # start-up is not judged here
    name, release = "slow-start", tmp_path / "release"
    config = _config(tmp_path, name, max_steps=60, task="tests.liveness_tasks:build",
                     task_args={"step_delay": 0.02, "slow_start_from_attempt": 2,
                                "release_file": str(release)})
    proc = _ci_run(tmp_path, name, config)
    instance = dg.DagsterInstance.get()
    try:
        _wait_committed(store_uri, name, 10)
        kill_at = time.time()
        os.kill(read_heartbeat_pid(Path(store_uri), "default", name), signal.SIGKILL)
        (run,) = instance.get_runs()
        wait_for(lambda: RunView.of(instance.get_run_by_id(run.run_id)).attempt == 2, 120,
                 what="the trainer's relaunch in its run")
        # Attempt 1's last beat is now older than the timeout; attempt 2 has not beaten.
        wait_for(lambda: time.time() - kill_at > 2 * timeout_s, 60, what="two timeouts")
        store = CheckpointStore(uri=store_uri)
        for _ in range(2):
            out = reconcile_training_runs(dg.build_sensor_context(
                instance=instance, resources={"checkpoint_store": store, **NO_MLFLOW}))
            assert isinstance(out, dg.SkipReason) or not list(out)
            view = RunView.of(instance.get_run_by_id(run.run_id))
            assert (view.status, view.heartbeat_lost) == (dg.DagsterRunStatus.STARTED, None)
        # The sweeps above saw only attempt 1's stale beat: attempt 2 was still starting.
        beat = json.loads((Path(store_uri) / "default" / name / "heartbeat.json").read_text())
        assert beat["attempt"] == 1, beat
        release.touch()
        code = proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, (tmp_path / f"{name}.log").read_text()[-6000:]
    (done,) = instance.get_runs()
    assert RunView.of(done).attempt == 2 and TAG_HEARTBEAT_LOST not in done.tags
