"""`ckpt-assets launch` queues one train_job run per launch, however many launches race.

Fast: `ckpt_assets.runs.submit` on a temporary SQLite instance made from the project's
dagster_home/dagster.yaml (the run queue: a submitted run waits, nothing trains).
Slow: real `python -m ckpt_assets launch` processes, and `dagster job launch` for the run
the in-process launch must reproduce."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.instance.ref import InstanceRef

from ckpt_assets.base.names import PARTITIONS_NAME
from ckpt_assets.base.registration import add_partition
from ckpt_assets.base.tags import PARTITION_TAG
from ckpt_assets.runs.submit import (
    launch_run_id,
    launch_training_run,
    open_training_location,
    plan_launch,
    submit,
)
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import DAGSTER, PYTHON, ROOT, cli, training_config

S = dg.DagsterRunStatus


@pytest.fixture
def queue_instance(dagster_home) -> dg.DagsterInstance:
    instance = dg.DagsterInstance.get()
    assert isinstance(instance.run_coordinator, dg.QueuedRunCoordinator)
    add_partition(instance, "same")
    return instance


def _own_instance(home: Path) -> dg.DagsterInstance:
    """Another connection to the same instance, as another process would open."""
    return dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))


def _runs(instance: dg.DagsterInstance, partition: str) -> list[dg.DagsterRun]:
    return instance.get_runs(filters=dg.RunsFilter(tags={PARTITION_TAG: partition}))


def test_launches_that_read_the_same_state_create_one_run_and_each_returns_it(queue_instance):
    first = plan_launch(queue_instance, "same", force=False)
    second = plan_launch(queue_instance, "same", force=False)  # before the first one creates
    assert first == second and first.active is None
    with open_training_location(queue_instance) as loc:
        won = submit(queue_instance, loc, first, {"team": "ml"})
        lost = submit(queue_instance, loc, second, {"team": "ml"})
    assert won.created and not lost.created
    assert lost.run.run_id == won.run.run_id == first.run_id
    (run,) = _runs(queue_instance, "same")
    assert run.status == S.QUEUED and run.tags["team"] == "ml"


def test_concurrent_launches_on_their_own_connections_create_exactly_one_run(
        queue_instance, dagster_home):
    n = 8
    barrier = threading.Barrier(n)
    results, errors = [], []

    def launcher(loc):
        with _own_instance(dagster_home) as instance:
            try:
                barrier.wait(60)
                results.append(submit(instance, loc, plan_launch(instance, "same",
                                                                 force=False)))
            except Exception as e:  # reported below: a thread's exception is otherwise lost
                errors.append(e)

    with open_training_location(queue_instance) as loc:
        threads = [threading.Thread(target=launcher, args=(loc,)) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert len(results) == n and sum(r.created for r in results) == 1
    (run,) = _runs(queue_instance, "same")
    assert {r.run.run_id for r in results} == {run.run_id}


def test_a_rival_launch_that_lands_between_a_launchs_two_reads_is_the_only_run(
        queue_instance, monkeypatch):
    """A launch reads the partition twice (its newest run, its active runs). Eight CLI
    launchers once queued two runs: a rival created its run between one launcher's reads."""
    import ckpt_assets.runs.submit as submit_module

    rival, started = [], []

    def then_a_rival_launches(read):
        def wrapped(instance, partition):
            result = read(instance, partition)
            if not started:  # after whichever read comes first, before the second
                started.append(True)  # the rival's own reads pass straight through
                rival.append(launch_training_run(queue_instance, partition))
            return result
        return wrapped

    for name in ("newest_training_run", "active_runs"):
        monkeypatch.setattr(submit_module, name,
                            then_a_rival_launches(getattr(submit_module, name)))
    plan = plan_launch(queue_instance, "same", force=False)
    with open_training_location(queue_instance) as loc:
        mine = submit(queue_instance, loc, plan)
    (won,) = rival
    assert won.created and not mine.created
    (run,) = _runs(queue_instance, "same")
    assert mine.run.run_id == won.run.run_id == run.run_id


def test_a_launch_queues_nothing_beside_an_active_run_unless_forced(queue_instance):
    first = launch_training_run(queue_instance, "same")
    again = launch_training_run(queue_instance, "same")
    assert first.created and not again.created and again.run.run_id == first.run.run_id
    forced = launch_training_run(queue_instance, "same", force=True)
    assert forced.created and forced.run.run_id != first.run.run_id
    assert len(_runs(queue_instance, "same")) == 2


def test_a_queued_launch_says_whether_a_daemon_will_dequeue_it(queue_instance, capsys):
    import time
    from types import SimpleNamespace

    from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import (
        QueuedRunCoordinatorDaemon,
    )
    from dagster._daemon.types import DaemonHeartbeat

    from ckpt_assets.cli.main import _print_launch

    reg = SimpleNamespace(run="same", experiment="default")
    launch = launch_training_run(queue_instance, "same")
    _print_launch(reg, launch, queue_instance)
    assert "no dagster-daemon runs the queue here" in capsys.readouterr().out
    queue = QueuedRunCoordinatorDaemon.daemon_type()  # the name the product reads, checked
    queue_instance.add_daemon_heartbeat(DaemonHeartbeat(time.time(), queue, "d", errors=[]))
    _print_launch(reg, launch, queue_instance)
    said = capsys.readouterr().out
    assert "a dagster-daemon runs the queue" in said and "no dagster-daemon" not in said


def test_after_the_newest_run_ended_a_launch_queues_the_next_and_deleted_runs_never_collide(
        queue_instance):
    ids = []
    for _ in range(3):
        launch = launch_training_run(queue_instance, "same")
        assert launch.created
        ids.append(launch.run.run_id)
        queue_instance.report_run_canceled(launch.run, message="ended for the test")
    assert len(set(ids)) == 3
    # A count of the partition's runs would name the third run again once one is deleted.
    queue_instance.delete_run(ids[0])
    fourth = launch_training_run(queue_instance, "same")
    assert fourth.created and fourth.run.run_id not in ids
    assert fourth.run.run_id == launch_run_id("same", ids[2])


def test_launch_run_ids_differ_by_partition_and_by_predecessor():
    ids = {launch_run_id(p, after) for p in ("a", "b") for after in (None, "x", "y")}
    assert len(ids) == 6
    assert launch_run_id("a", "x") == launch_run_id("a", "x")


def test_concurrent_registrations_add_the_partition_once(queue_instance, dagster_home):
    barrier = threading.Barrier(6)
    errors = []

    def register():
        with _own_instance(dagster_home) as instance:
            try:
                barrier.wait(60)
                add_partition(instance, "fresh")
            except Exception as e:
                errors.append(e)

    threads = [threading.Thread(target=register) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert queue_instance.get_dynamic_partitions(PARTITIONS_NAME).count("fresh") == 1


def test_a_launch_tag_that_names_another_partition_is_refused(tmp_path, dagster_home,
                                                             store_uri, capsys):
    from ckpt_assets.cli.main import main as cli_main

    config = tmp_path / "train.json"
    config.write_text(json.dumps(training_config()))
    assert cli_main(["launch", "tagged", "--config", str(config),
                     "--tag", f"{PARTITION_TAG}=other"]) == 2
    assert "the partition is the training run's name" in capsys.readouterr().err
    assert not Path(store_uri).exists()


@pytest.mark.slow
def test_eight_concurrent_cli_launches_of_one_name_queue_exactly_one_run(
        tmp_path, dagster_home, store_uri):
    config = tmp_path / "train.json"
    config.write_text(json.dumps(training_config()))
    dg.DagsterInstance.get().get_runs(limit=1)  # the SQLite schema, created once (not raced)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([PYTHON, "-m", "ckpt_assets", "launch", "raced", "--config",
                               str(config)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out + err
    instance = dg.DagsterInstance.get()
    (run,) = _runs(instance, "raced")
    assert run.status == S.QUEUED
    # Each launcher names the one run: the one that queued it, and every one that did not.
    assert all(run.run_id in out for out, _ in outputs)
    assert sum(out.startswith("launched train_job") for out, _ in outputs) == 1


@pytest.mark.slow
def test_ckpt_assets_launch_creates_the_run_dagster_job_launch_creates(queue_instance, tmp_path):
    """`dagster job launch -w workspace.yaml`, the way launch used to submit, and
    `ckpt-assets launch`, which submits in-process: the same job, plan, tags, config and
    code location origin. Both are real processes: a fresh interpreter is what a user
    runs, and in this test process the definitions were already resolved by other tests
    (Dagster caches the repository on the Definitions object, load data and all)."""
    add_partition(queue_instance, "via-cli")
    old_id = launch_run_id("via-cli", None)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([DAGSTER, "job", "launch", "-w", str(ROOT / "workspace.yaml"), "-j",
                           "train_job", "--tags", json.dumps({PARTITION_TAG: "via-cli"}),
                           "--run-id", old_id], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = tmp_path / "train.json"
    config.write_text(json.dumps(training_config()))
    proc = subprocess.run([PYTHON, "-m", "ckpt_assets", "launch", "same", "--config",
                           str(config)], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    old = queue_instance.get_run_by_id(old_id)
    (new,) = _runs(queue_instance, "same")
    for field in ("job_name", "run_config", "status", "step_keys_to_execute", "op_selection",
                  "job_snapshot_id", "execution_plan_snapshot_id", "remote_job_origin",
                  "has_repository_load_data", "asset_selection"):
        assert getattr(new, field) == getattr(old, field), field
    assert {**new.tags, PARTITION_TAG: "via-cli"} == old.tags
    new_repo, old_repo = (r.job_code_origin.repository_origin for r in (new, old))
    assert new.job_code_origin.job_name == old.job_code_origin.job_name
    assert (new_repo.code_pointer, new_repo.entry_point) == (old_repo.code_pointer,
                                                             old_repo.entry_point)
    assert new.remote_job_origin.location_name == "ckpt_assets"


IMMEDIATE_INSTANCE = """
telemetry:
  enabled: false
run_coordinator:
  module: dagster.core.run_coordinator
  class: DefaultRunCoordinator
run_launcher:
  module: dagster.core.launcher
  class: DefaultRunLauncher
"""


@pytest.mark.slow
def test_an_instance_without_the_run_queue_has_the_launched_run_run_at_once(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    # No queue: the run coordinator launches the run itself, through a code server, so the
    # workspace is served as `dagster job launch` serves it (and, as then, the command
    # returns once the code server it started has finished the run).
    (dagster_home / "dagster.yaml").write_text(IMMEDIATE_INSTANCE)
    config = tmp_path / "train.json"
    config.write_text(json.dumps(training_config()))
    proc = cli("launch", "unqueued", "--config", str(config), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = _runs(dg.DagsterInstance.get(), "unqueued")
    assert run.status == S.SUCCESS
    assert run.remote_job_origin.location_name == "ckpt_assets"
