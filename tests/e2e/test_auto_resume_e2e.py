"""Kill a training run the ways a cluster does; a real dagster-daemon resumes it, exactly once.

One test per guarantee that needs the real daemon, run workers and trainers; what the
sensors decide for each kind of failure is proven in seconds by tests/orchestrator/test_sensors.py and
tests/orchestrator/test_policy.py. A failure seen once and resumed once, through the sensors'
reads and writes of the instance's storage, is proven on both instance kinds: the embedded
default (dagster_home/dagster.yaml, SQLite, MLflow in a SQLite file) and the team instance
(deploy/postgres/dagster.yaml on the session's real PostgreSQL server, MLflow in a second
database on that server). A lost run worker is found and resumed through the same kinds of
storage calls (runs and their tags read, tags and run events written), so it is proven on
the embedded instance only. One daemon (with the code server it spawns)
serves each kind (the embedded one is shared, tests/e2e/conftest.py); each test trains
its own partition, its first attempt held at the step where it is interrupted. A `command:` run (the digits
classifier in its own loop) is resumed through the same daemon; what differs between the
examples (their own loops, SIGTERM as well as SIGKILL) is proven standalone by
tests/standalone/test_examples_standalone.py.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckpt_assets.base.attempt_processes import AttemptProcesses
from ckpt_assets.base.tags import TAG_DECISION
from ckpt_assets.lifecycle.settings import Setting
from ckpt_assets.lifecycle.stop import stop_training_run
from tests.daemon_harness import (
    ROOT,
    Daemon,
    baseline_config,
    kill,
    trainer_parent,
    training_config,
)
from tests.postgres_server import team_instance
from tests.trainer_proc import assert_bitwise_equal, final_state, training_state
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import open_store

pytestmark = pytest.mark.slow

INSTANCE_KINDS = ("sqlite", "postgres")
# On the embedded instance a killed trainer's sensor resume is proven by the command run's
# below; PostgreSQL proves the same path once on a team's instance.
on_the_team_instance = pytest.mark.parametrize("daemon", INSTANCE_KINDS[1:], indirect=True)
on_the_embedded_instance = pytest.mark.parametrize("daemon", INSTANCE_KINDS[:1], indirect=True)
SLOW_STEPS = ["python", "tests/slow_steps.py"]  # STEP_DELAY seconds per step: room to signal
RNG = random.Random(20261129)


@pytest.fixture
def daemon(request, sensors_daemon):
    # This module proves the sensors' path: a killed trainer's run fails and is resumed as
    # a new run, exactly once. A trainer killed while its run worker lives is relaunched
    # in its own run by default, so that is turned off here; the default is proven by
    # tests/orchestrator/test_in_run_relaunch.py, under a daemon too. On the embedded
    # instance that daemon is the one shared with test_ranks_dagster.
    if request.param == "sqlite":
        return sensors_daemon.get()
    return request.getfixturevalue("team_daemon")


@pytest.fixture
def team_daemon(tmp_path_factory, postgres_server):
    # One test runs on it: stopped after it, not idle (sensor ticks) until the module ends.
    work = tmp_path_factory.mktemp("e2e-postgres")
    instance = team_instance(postgres_server, work)
    instance["extra_env"] = {**instance.get("extra_env", {}), Setting.IN_RUN_RELAUNCH.value: "0"}
    d = Daemon.start(work, str(work / "store"), **instance)
    yield d
    d.stop()


def held(run: str, after_step: int = 15) -> dict:
    """The run's config, its first attempt held after `after_step` until it is interrupted
    (the toy task's `pause_after_step`: no clock to race); the resumed attempt trains on."""
    cfg = training_config(run)
    cfg["task_args"] = {**{k: v for k, v in cfg["task_args"].items() if k != "step_delay"},
                        "pause_after_step": after_step}
    return cfg


def _resumes_of(daemon: Daemon, run_id: str) -> list:
    return [r for r in daemon.instance.get_runs() if r.tags.get("ckpt/parent_run_id") == run_id]


def _check_resumed_once_and_identical(daemon, name, uninterrupted, failed_runs: int):
    final = daemon.wait_done(name)
    runs = daemon.runs(name)
    # A resume whose run worker took longer than run monitoring's start timeout to start (a
    # busy machine) is failed by Dagster and resumed in turn, as dagster.yaml documents: a
    # failure of its own, not one of the test's, and still resumed exactly once.
    started_late = [r for r in runs[1:-1] if daemon.start_timed_out(r.run_id)]
    assert len(runs) == failed_runs + len(started_late) + 1, \
        daemon.state_of(name) + "\n" + daemon.failures_of(name)
    for failed in runs[:-1]:
        assert len(_resumes_of(daemon, failed.run_id)) == 1
        assert failed.tags.get("ckpt/decision") == "resume"
    assert final.tags["ckpt/parent_run_id"] == runs[-2].run_id
    assert final.tags["ckpt/root_run_id"] == runs[0].run_id
    assert final.tags["ckpt/attempt"] == str(len(runs))
    assert daemon.max_active[name] == 1
    got = training_state(final_state(Path(daemon.store), run=name))
    assert_bitwise_equal(uninterrupted(baseline_config()), got)
    # Nothing committed is missing from Dagster's lineage: every parent link resolves,
    # across the seam between the attempts too.
    recorded = _checkpoint_events(daemon, name)
    names = {m["name"] for m in recorded}
    dangling = [(m["name"], m["parent"]) for m in recorded if m["parent"] and m["parent"] not in names]
    assert dangling == [], dangling
    _check_one_mlflow_run(daemon, name, final, attempts=len(runs))


def _check_one_mlflow_run(daemon, name, final, attempts: int):
    """MLflow, on the instance's tracking URI, holds one run for the training run that the
    attempts continued, with one step axis."""
    from mlflow.tracking import MlflowClient

    from ckpt_assets.mlflow.tracking import TRAINING_RUN_TAG

    client = MlflowClient(tracking_uri=daemon.env["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              filter_string=f"tags.{TRAINING_RUN_TAG} = '{name}'")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["dagster_run_id"] == final.run_id
    assert run.data.tags["attempt"] == str(attempts)
    # One point per step (a late catch-up logs older steps after newer ones: MLflow plots
    # by step), up to the run's last.
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    assert len(steps) == len(set(steps)), steps
    assert max(steps) == training_config(name)["max_steps"], steps


def _checkpoint_events(daemon, name) -> list[dict]:
    from ckpt_assets.base.events import CHECKPOINT, partition_events

    return [md for md, _ in partition_events(daemon.instance, name, CHECKPOINT)]


@on_the_team_instance
def test_sigkill_of_the_trainer_is_resumed_once_and_ends_bitwise_identical(
        daemon, tmp_path, uninterrupted):
    daemon.launch("kill-trainer", held("kill-trainer"), tmp_path)
    hb = daemon.wait_for_step("kill-trainer", 15, attempt=1)
    kill(hb["pid"], signal.SIGKILL)
    _check_resumed_once_and_identical(daemon, "kill-trainer", uninterrupted, failed_runs=1)
    failed = daemon.runs("kill-trainer")[0]
    assert failed.tags["ckpt/failure_kind"] == "killed"


@on_the_embedded_instance
def test_sigkill_of_the_run_worker_stops_its_trainer_and_is_resumed_once(
        daemon, tmp_path, uninterrupted):
    daemon.launch("kill-worker", held("kill-worker"), tmp_path)
    hb = daemon.wait_for_step("kill-worker", 15, attempt=1)
    worker = trainer_parent(hb["pid"])
    kill(worker, signal.SIGKILL)
    _check_resumed_once_and_identical(daemon, "kill-worker", uninterrupted, failed_runs=1)
    # The orphaned trainer did not train on: it stopped when its parent died.
    with pytest.raises(FileNotFoundError):
        Path(f"/proc/{hb['pid']}/stat").read_text()
    # The output file the dead worker could not remove, the next attempt did.
    lost = AttemptProcesses.of_run(daemon.runs("kill-worker")[0])
    assert lost is not None and not Path(lost.output).exists(), lost
    # What it committed on the way out was recorded by the next attempt, and the lineage
    # report numbers the lost attempt and says how it ended.
    from ckpt_assets.records.lineage import format_lineage, lineage_report
    from trainer.storage import open_store

    late = [m for m in _checkpoint_events(daemon, "kill-worker")
            if m.get("recorded_late")]
    # (An earlier checkpoint whose report the worker had not read yet is recorded late too.)
    assert late and all(m["attempt"] == 1 for m in late), late
    assert late[-1]["reason"] == "preempted", late  # the commit on SIGTERM, on the way out
    rep = lineage_report(daemon.instance, open_store(daemon.store), "kill-worker")
    lost = rep["attempts"][0]
    assert (lost["attempt"], lost["end"]) == (1, "worker_lost"), lost
    assert lost["last_committed_step"] == late[-1]["step"]
    assert "attempt ?" not in format_lineage(rep)
    # No step recorded the lost attempt's end: its decider did, by the decision's name.
    names = daemon.outcome_names("kill-worker", lost["dagster_run_id"], attempt=1)
    assert set(names.values()) == {"worker_lost"}, names


@on_the_embedded_instance
def test_terminating_the_run_from_dagster_is_a_preemption_that_resumes(
        daemon, tmp_path, uninterrupted):
    daemon.launch("terminate", held("terminate"), tmp_path)
    daemon.wait_for_step("terminate", 15, attempt=1)
    run = daemon.runs("terminate")[0]
    assert daemon.instance.run_launcher.terminate(run.run_id)
    _check_resumed_once_and_identical(daemon, "terminate", uninterrupted, failed_runs=1)
    first = daemon.runs("terminate")[0]
    assert first.status.value == "CANCELED"
    assert first.tags["ckpt/failure_kind"] == "preempted"
    # A terminate is `terminated` wherever it is read: not the trainer's SIGTERM exit (143,
    # `preempted`) that the terminate caused.
    names = daemon.outcome_names("terminate", first.run_id, attempt=1)
    assert set(names.values()) == {"terminated"}, names


def _standalone(argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "DAGSTER_"))}
    res = subprocess.run([sys.executable, *argv], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr


@on_the_embedded_instance
def test_a_sigkilled_command_run_is_resumed_once_with_its_checkpoint_and_ends_bitwise_identical(
        daemon, tmp_path):
    argv = ["examples/digits/train.py", "--steps", "120"]
    _standalone([*argv, "--store", str(tmp_path / "base")])
    want = final_state(tmp_path / "base", "digits", "digits")
    # A heartbeat every step or two: the kill lands at the step drawn, not seconds later.
    config = {"command": [*SLOW_STEPS, *argv], "max_steps": 120, "env": {"STEP_DELAY": "0.05"},
              "checkpoint": {"heartbeat_seconds": 0.05}}
    daemon.launch("digits-cmd", config, tmp_path)
    # After its first commit (every 25 steps), so the resume is handed a checkpoint.
    hb = daemon.wait_for_step("digits-cmd", RNG.randint(30, 90), attempt=1)
    kill(hb["pid"], signal.SIGKILL)
    final = daemon.wait_done("digits-cmd", timeout=600)
    first, resumed = daemon.runs("digits-cmd")
    assert (first.tags["ckpt/decision"], first.tags["ckpt/failure_kind"]) == ("resume", "killed")
    assert resumed.run_id == final.run_id and final.tags["ckpt/attempt"] == "2"
    assert final.tags["ckpt/resume_from"].startswith(Path(daemon.store).as_uri())
    assert daemon.max_active["digits-cmd"] == 1
    assert_bitwise_equal(want, final_state(Path(daemon.store), "default", "digits-cmd"))


# -- a stop for good under races: one name in every view ----------------------------------

def _stopped_in_every_view(daemon: Daemon, name: str, run_id: str) -> None:
    """The run's only attempt reads `stopped_by_user` in all six views once its stop was
    decided, and nothing resumed it."""
    daemon.wait_until(lambda: daemon.instance.get_run_by_id(run_id).tags.get(TAG_DECISION),
                      f"the sensors to decide the stop of {name}", run=name)
    names = daemon.outcome_names(name, run_id, attempt=1)
    assert set(names.values()) == {"stopped_by_user"}, names
    assert [r.run_id for r in daemon.runs(name)] == [run_id]


@on_the_embedded_instance
def test_two_stops_racing_name_the_attempt_stopped_by_user_in_every_view(daemon, tmp_path):
    from dagster import DagsterInstance
    from dagster._core.instance.ref import InstanceRef

    name = "two-stops"
    daemon.launch(name, held(name, after_step=2), tmp_path)
    daemon.wait_for_step(name, 2, attempt=1)
    (run,) = daemon.runs(name)
    both = threading.Barrier(2)

    def stop(reason: str):  # each as its own client of the instance, released together
        instance = DagsterInstance.from_ref(InstanceRef.from_dir(str(daemon.home)))
        both.wait(30)
        return stop_training_run(instance, name, reason)

    with ThreadPoolExecutor(2) as pool:
        acted = [f.result() for f in [pool.submit(stop, w) for w in ("first", "second")]]
    assert all(acted), acted  # each found the run to stop
    _stopped_in_every_view(daemon, name, run.run_id)


@on_the_embedded_instance
def test_a_stop_as_the_trainer_reaches_its_last_step_names_it_stopped_by_user_in_every_view(
        daemon, tmp_path):
    # The trainer holds after step 9 of 10 until the stop's SIGTERM, which it takes up as it
    # trains step 10: the stop arrives as its last step is committed.
    name = "last-step"
    daemon.launch(name, {**held(name, after_step=9), "max_steps": 10}, tmp_path)
    daemon.wait_for_step(name, 9, attempt=1)
    (run,) = daemon.runs(name)
    stop_training_run(daemon.instance, name, "at the end")
    _stopped_in_every_view(daemon, name, run.run_id)
    # Its last step was committed, by the stop, and is not the run's end: stopped, not done.
    pointer = CheckpointRepo(open_store(daemon.store), "default", name).read_pointer()
    assert pointer.step == 10
    assert daemon.instance.get_run_by_id(run.run_id).status.value == "CANCELED"


@on_the_embedded_instance
def test_a_stop_after_the_run_worker_was_sigkilled_names_it_stopped_by_user_in_every_view(
        daemon, tmp_path):
    # No step is left to record the attempt's end: its decider records it (the event, MLflow).
    name = "stop-lost"
    daemon.launch(name, held(name, after_step=2), tmp_path)
    hb = daemon.wait_for_step(name, 2, attempt=1)
    (run,) = daemon.runs(name)
    kill(trainer_parent(hb["pid"]), signal.SIGKILL)
    stop_training_run(daemon.instance, name, "after its worker died")
    _stopped_in_every_view(daemon, name, run.run_id)
