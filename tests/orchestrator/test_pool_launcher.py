"""The run pool's launcher (`ckpt_assets.runs.pool_launcher`): a run's worker forked from a
warm server runs the run as a cold one does, and a training run is handed the spare worker
whose standby trainer becomes its first attempt; a code change restarts the server (its
spare and standby exit with it); a pool that
cannot serve (its server cannot start, or answers nothing) falls back to the default
launcher's cold start, and says why; terminating a pooled run cancels it as a cold run's
terminate does.

Real processes throughout: `python -m ckpt_assets launch` against an instance without the
run queue (launching starts the run) whose run launcher is the pool's
(tests/orchestrator/pool_launcher_instance.yaml), the fork server it starts, the run workers
it forks and their trainers."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import socket
from pathlib import Path

import dagster as dg
import pytest
import yaml

from ckpt_assets.attempt.process import PROCESS_STARTED, WARM_STARTED
from ckpt_assets.runs.tags import PARTITION_TAG
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import cli, pointer_step, training_config
from tests.polling import pid_alive, wait_for

S = dg.DagsterRunStatus
POOL_INSTANCE = Path(__file__).with_name("pool_launcher_instance.yaml")
GRPC_INFO_TAG = ".dagster/grpc_info"  # what the default launcher records on a cold run
FORKED = re.compile(r"Run worker (\d+) forked from the run pool's server (\d+)")
STARTED = re.compile(r"Started process for run \(pid: (\d+)\)")
POOL_REFUSED = "The run pool cannot start this run"
STANDBY_AHEAD = re.compile(r"run worker (\d+): standby trainer (\d+) started ahead of the run")


def write_instance(home: Path, **pool_config) -> None:
    raw = yaml.safe_load(POOL_INSTANCE.read_text())
    raw["run_launcher"]["config"].update(pool_config)
    (home / "dagster.yaml").write_text(yaml.safe_dump(raw))


@pytest.fixture
def pool_home(dagster_home, store_uri, mlflow_uri):
    yield dagster_home
    for info in dagster_home.rglob("server.json"):  # the servers the tests started
        stop_server(info)


def stop_server(info: Path) -> None:
    try:
        pid = json.loads(info.read_text())["pid"]
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, KeyError):
        return
    if b"ckpt_assets.runs.fork_server" in cmdline:
        os.kill(pid, signal.SIGTERM)


def start(tmp_path: Path, name: str, **overrides) -> dg.DagsterRun:
    """Launch training run `name` with the CLI; its Dagster run."""
    overrides = {"max_steps": 20, "eval_every": 0, **overrides}
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps(training_config(**overrides)))
    proc = cli("launch", name, "--config", str(config), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = dg.DagsterInstance.get().get_runs(filters=dg.RunsFilter(tags={PARTITION_TAG: name}))
    return run


def ended(run: dg.DagsterRun) -> dg.DagsterRun:
    instance = dg.DagsterInstance.get()
    return wait_for(lambda: (now := instance.get_run_by_id(run.run_id)).is_finished and now,
                    300, 0.2, f"run {run.run_id} to end")


def launch(tmp_path: Path, name: str, **overrides) -> dg.DagsterRun:
    """Launch training run `name` with the CLI, then wait for its Dagster run to end."""
    return ended(start(tmp_path, name, **overrides))


def engine_messages(run: dg.DagsterRun) -> list[str]:
    return [(e.dagster_event.message if e.dagster_event else e.user_message) or ""
            for e in dg.DagsterInstance.get().all_logs(run.run_id)]


def forked_by(run: dg.DagsterRun) -> tuple[int, int]:
    """(the run worker's pid, the fork server's pid) of a pooled run."""
    (hit,) = [m for msg in engine_messages(run) if (m := FORKED.search(msg))]
    return int(hit.group(1)), int(hit.group(2))


@pytest.mark.slow
@pytest.mark.warm_standby
def test_a_pooled_training_run_runs_in_the_spare_worker_its_standby_trains_and_a_code_change_restarts_the_pool(
        tmp_path, pool_home, store_uri):
    # That a pool which cannot serve starts the run cold: the tests below (a server that
    # answers nothing; any fault inside the pool). A worker forked for its run (standbys
    # off, or a run that does not train): the other tests here.
    watched = tmp_path / "watched.py"
    watched.write_text("VERSION = 1\n")
    write_instance(pool_home, watch_paths=[str(watched)])
    pooled = launch(tmp_path, "pooled")
    assert pooled.status == S.SUCCESS, engine_messages(pooled)
    worker, server = forked_by(pooled)
    # The process that ran the run is the one the server forked, not a fresh
    # `dagster api execute_run`, and no code server was asked to start it.
    messages = engine_messages(pooled)
    (started,) = [int(m.group(1)) for msg in messages if (m := STARTED.search(msg))]
    assert started == worker
    assert GRPC_INFO_TAG not in pooled.tags
    # It was the spare, forked before the run came, and the standby it started then became
    # the run's first attempt.
    log = pool_home / "run_pool" / "server.log"
    assert (f"fork server {server}: run worker {worker} (forked ahead, its standby trainer "
            f"ready) takes run {pooled.run_id}") in log.read_text()
    assert any("before the run, by the run pool" in m for m in messages), messages
    (attempt,) = [m for m in messages if m.startswith(PROCESS_STARTED)]
    assert WARM_STARTED in attempt
    assert (pool_home / "run_pool" / "runs" / f"{pooled.run_id}.log").exists()
    assert pointer_step(Path(store_uri), "default", "pooled") == 20
    # Its record (what terminate reads) goes once its worker has exited; its log stays.
    wait_for(lambda: not (pool_home / "run_pool" / "runs" / f"{pooled.run_id}.json").exists(),
             60, 0.1, "the ended run's record to go")
    # The next spare comes with a standby of its own.
    ahead = wait_for(lambda: [m for m in STANDBY_AHEAD.finditer(log.read_text())
                              if int(m.group(1)) != worker], 120, 0.2, "the next spare")
    spare, standby = int(ahead[0].group(1)), int(ahead[0].group(2))
    assert pid_alive(spare) and pid_alive(standby)

    watched.write_text("VERSION = 22\n")  # another size: a change whatever the mtime's grain
    changed = launch(tmp_path, "after-change")
    assert changed.status == S.SUCCESS, engine_messages(changed)
    assert forked_by(changed)[1] != server
    assert f"fork server {server}: the code changed since it was loaded" in log.read_text()
    # The old server's unused spare and its standby, of the old code, exit with it.
    wait_for(lambda: gone(server) and gone(spare) and gone(standby), 60, 0.1,
             "the old server, its spare and the spare's standby to exit")


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return True
    return state == b"Z"


def training(tmp_path: Path, pool_home: Path, store_uri: str, name: str) -> dg.DagsterRun:
    """A pooled run of training run `name` that trains on, once its first checkpoint is in."""
    write_instance(pool_home)
    run = start(tmp_path, name, max_steps=100000, task_args={"step_delay": 0.05})
    wait_for(lambda: (pointer_step(Path(store_uri), "default", name) or 0) >= 10, 300,
             0.1, "the first checkpoint")
    return run


@pytest.mark.slow
def test_terminating_a_pooled_run_interrupts_its_worker_and_the_run_ends_canceled(
        tmp_path, pool_home, store_uri):
    run = training(tmp_path, pool_home, store_uri, "stopped")
    worker, server = forked_by(run)
    # While it runs: the run worker is the fork server's child, with the server's command
    # line (a fork, not a fresh `dagster api execute_run`).
    assert parent_of(worker) == server
    assert b"ckpt_assets.runs.fork_server" in Path(f"/proc/{worker}/cmdline").read_bytes()
    instance = dg.DagsterInstance.get()
    assert instance.run_launcher.terminate(run.run_id) is True
    run = ended(run)
    assert run.status == S.CANCELED, engine_messages(run)
    wait_for(lambda: gone(worker), 60, 0.1, "the pooled run worker to exit")
    assert instance.run_launcher.terminate(run.run_id) is False  # finished: nothing to stop


@pytest.mark.slow
def test_a_killed_pooled_run_worker_has_its_run_failed_by_the_server_as_a_code_server_would(
        tmp_path, pool_home, store_uri):
    # No daemon, no sensor, no reconciler here: only the server, the worker's parent, can
    # say that the run's worker is gone, as Dagster's code server does for its own.
    run = training(tmp_path, pool_home, store_uri, "killed")
    worker, _ = forked_by(run)
    os.kill(worker, signal.SIGKILL)
    run = ended(run)
    assert run.status == S.FAILURE, engine_messages(run)
    (why,) = [m for m in engine_messages(run) if m.startswith("Run execution process for")]
    assert why.startswith(f"Run execution process for {run.run_id} was terminated by signal 9")


@pytest.mark.slow
def test_a_forked_worker_whose_launcher_gave_up_leaves_the_run_to_its_cold_start(
        tmp_path, pool_home):
    # The launcher that stopped waiting starts the run cold; the worker forked for it never
    # hears GO and exits, and the server must not then fail the run the cold worker runs.
    import subprocess
    import sys

    from dagster._core.definitions.reconstruct import ReconstructableRepository
    from dagster._core.origin import JobPythonOrigin
    from dagster._core.test_utils import create_run_for_test

    from ckpt_assets.runs.code_fingerprint import PROJECT_PACKAGES, code_fingerprint
    from ckpt_assets.runs.dagster_private import execute_run_args

    root = os.getcwd()
    repo = ReconstructableRepository.for_module("ckpt_assets.definitions", "defs", root)
    instance = dg.DagsterInstance.get()
    run = create_run_for_test(instance, job_name="train_job",
                              job_code_origin=JobPythonOrigin("train_job",
                                                              repo.get_python_origin()))
    pool = tmp_path / "pool"
    pool.mkdir()
    server = subprocess.Popen(
        [sys.executable, "-m", "ckpt_assets.runs.fork_server", "--root", str(pool), "--module",
         "ckpt_assets.definitions", "--attribute", "defs", "--working-directory", root,
         "--idle-exit-s", "120"], stdout=open(tmp_path / "server.log", "wb"),
        stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: (pool / "fork.sock").exists() and (pool / "server.json").exists(),
                 120, 0.1, "the fork server to listen")
        request = {"fingerprint": code_fingerprint(list(PROJECT_PACKAGES)),
                   "code": {"module": "ckpt_assets.definitions", "attribute": "defs",
                            "working_directory": root, "executable": sys.executable},
                   "run_id": run.run_id, "execute_args": execute_run_args(run, instance),
                   "env": dict(os.environ), "cwd": root, "log": str(tmp_path / "run.log")}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(pool / "fork.sock"))
            conn.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(conn.makefile().readline())
        # Closed without GO, as a launcher that gave up closes it.
        said = f"run worker {reply['pid']} exited without running its run (no go)"
        wait_for(lambda: said in (tmp_path / "server.log").read_text(), 60, 0.1,
                 "the server to reap the worker that never ran")
        assert not instance.get_run_by_id(run.run_id).is_finished
        assert not [m for m in engine_messages(run) if m.startswith("Run execution process")]
    finally:
        server.terminate()
        server.wait(30)


@pytest.mark.slow
def test_a_pool_server_that_answers_nothing_in_time_has_the_run_started_cold(
        tmp_path, pool_home):
    pool = tmp_path / "pool"
    pool.mkdir()
    # A server that listens and never answers: a socket nobody accepts on, and the pool's
    # lock held, so the launcher starts no server of its own.
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(str(pool / "fork.sock"))
    mute.listen(8)
    lock = os.open(pool / "server.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        write_instance(pool_home, pool_directory=str(pool), reply_timeout_seconds=1.0)
        run = launch(tmp_path, "mute")
    finally:
        mute.close()
        os.close(lock)
    assert run.status == S.SUCCESS, engine_messages(run)
    (why,) = [m for m in engine_messages(run) if m.startswith(POOL_REFUSED)]
    assert "gave no answer within 1s" in why
    assert GRPC_INFO_TAG in run.tags


def test_a_fault_inside_the_pool_starts_the_run_cold_and_says_why(dagster_home, monkeypatch):
    # Not only the faults the pool foresees (PoolUnavailable): whatever `_fork` raises, no
    # forked worker was told to run, so the run must start cold, never be lost.
    from dagster._core.launcher import LaunchRunContext
    from dagster._core.test_utils import create_run_for_test

    from ckpt_assets.runs.pool_launcher import PoolRunLauncher

    def broken_fork(self, run):
        raise TypeError("a bug in the pool")

    cold: list[str] = []
    monkeypatch.setattr(PoolRunLauncher, "_fork", broken_fork)
    monkeypatch.setattr(dg.DefaultRunLauncher, "launch_run",
                        lambda self, context: cold.append(context.dagster_run.run_id))
    instance = dg.DagsterInstance.get()
    assert isinstance(instance.run_launcher, PoolRunLauncher)  # the embedded default's
    run = create_run_for_test(instance, job_name="train_job")
    instance.run_launcher.launch_run(LaunchRunContext(dagster_run=run, workspace=None))
    assert cold == [run.run_id]
    (why,) = [m for m in engine_messages(run) if m.startswith(POOL_REFUSED)]
    assert "TypeError: a bug in the pool" in why and "starting it cold" in why


def test_an_ended_runs_record_goes_and_only_the_newest_runs_logs_are_kept(tmp_path, monkeypatch):
    from ckpt_assets.runs import fork_server
    from ckpt_assets.runs.run_pool import PoolPaths

    monkeypatch.setattr(fork_server, "LOGS_KEPT", 3)
    paths = PoolPaths(tmp_path)
    paths.runs.mkdir()
    for i in range(5):
        paths.run_log(f"r{i}").write_text("output")
        os.utime(paths.run_log(f"r{i}"), (1000 + i, 1000 + i))
    paths.run_record("r4").write_text("{}")
    fork_server.forget_run(paths, "r4")
    assert not paths.run_record("r4").exists()
    assert sorted(f.name for f in paths.runs.iterdir()) == ["r2.log", "r3.log", "r4.log"]


def test_a_run_launched_from_the_cli_and_one_a_sensor_submitted_name_the_same_pooled_code():
    # The CLI records the code's working directory as given ("."), a code server as its own
    # absolute path; were they compared as written, the pool would refuse every resume.
    from dagster._core.definitions.reconstruct import ReconstructableRepository
    from dagster._core.origin import JobPythonOrigin

    from ckpt_assets.runs.dagster_private import run_code

    def code_of(directory: str):
        repo = ReconstructableRepository.for_module("ckpt_assets.definitions", "defs", directory)
        origin = JobPythonOrigin("train_job", repo.get_python_origin())
        return run_code(dg.DagsterRun(job_name="train_job", run_id="r", job_code_origin=origin))

    assert code_of(".") == code_of(os.getcwd())
    assert code_of(".").working_directory == os.getcwd()
