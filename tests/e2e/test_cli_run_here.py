"""`ckpt-assets run` as a user meets it once the first run worked: a store named on the
command line, a script that raises, a torchrun script at one rank, an attempt relaunched in
its run and then lost with its run worker. Real processes, real signals, no daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import PYTHON, ROOT, cli, pointer_step, read_heartbeat_pid
from tests.polling import pid_alive, wait_for
from trainer.base.outcomes import Outcome

pytestmark = pytest.mark.slow

# An own-loop script: `--raise-at N` raises at step N; `--local-rank` reads LOCAL_RANK as
# a torchrun script does (it is there only under the ranks launcher).
SCRIPT = """\
import argparse, os, time
import torch
from trainer import CheckpointSession

p = argparse.ArgumentParser()
p.add_argument("--raise-at", type=int, default=0)
p.add_argument("--local-rank", action="store_true")
p.add_argument("--delay", type=float, default=0.0)
args = p.parse_args()
if args.local_rank:
    print(f"local rank {int(os.environ['LOCAL_RANK'])}", flush=True)
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with CheckpointSession(every_steps=5, max_steps=STEPS) as ckpt:
    start = ckpt.restore(model=model, optimizer=opt)
    for step in range(start + 1, STEPS + 1):
        if step == args.raise_at:
            raise ValueError(f"the schedule has no learning rate for step {step}")
        loss = model(torch.randn(8, 3)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.delay)
        if ckpt.step(step, loss=loss):
            break
"""


def _command_run(tmp_path: Path, name: str, *args: str, steps: int = 20, **config) -> Path:
    (tmp_path / "train.py").write_text(SCRIPT.replace("STEPS", str(steps)))
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"command": ["python", "train.py", *args],
                                "cwd": str(tmp_path), "max_steps": steps, **config}))
    return path


def test_run_with_store_registers_trains_and_reports_in_the_store_it_names(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    # $CKPT_STORE_URI names another store: the command line's is the one that counts.
    named = tmp_path / "named-store"
    config = _command_run(tmp_path, "w")
    proc = cli("run", "w", "--store", str(named), "--config", str(config))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "training run w finished at step 20" in proc.stdout
    assert pointer_step(named, "default", "w") == 20
    assert not (Path(store_uri) / "default" / "w").exists()
    (row,) = [r for r in json.loads(cli("list", "--json", "--store", str(named)).stdout)
              if r["run"] == "w"]
    assert row["state"] == "finished"
    assert json.loads(cli("lineage", "w", "--json", "--store", str(named)).stdout)[
        "latest_checkpoint"]


def test_launch_refuses_a_store_its_daemon_would_not_train_in_with_exit_2_and_queues_nothing(
        tmp_path, dagster_home, store_uri):
    config = _command_run(tmp_path, "elsewhere")
    proc = cli("launch", "elsewhere", "--store", str(tmp_path / "other"), "--config",
               str(config))
    assert proc.returncode == Outcome.BAD_INPUT.exit_code, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "ckpt-assets run elsewhere --store" in line and "CKPT_STORE_URI" in line
    assert not (tmp_path / "other").exists() or not any((tmp_path / "other").iterdir())


def test_a_run_whose_script_raises_shows_the_exception_and_says_nothing_was_committed(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    config = _command_run(tmp_path, "raises", "--raise-at", "3")
    proc = cli("run", "raises", "--config", str(config))
    assert proc.returncode == Outcome.USER_CODE_ERROR.exit_code, proc.stdout + proc.stderr
    out = proc.stdout
    assert "ended user_code_error (exit 1); nothing committed yet" in out, out
    assert "ValueError: the schedule has no learning rate for step 3" in out
    assert 'File "train.py", line' in out and "raise ValueError" in out
    assert "None" not in out and "runpy" not in out, out


def test_a_run_whose_script_raises_after_a_commit_names_that_step_and_the_exception(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    config = _command_run(tmp_path, "raises-late", "--raise-at", "8")
    proc = cli("run", "raises-late", "--config", str(config))
    assert proc.returncode == Outcome.USER_CODE_ERROR.exit_code, proc.stdout + proc.stderr
    assert "ended user_code_error (exit 1); last committed step 5" in proc.stdout
    assert "ValueError: the schedule has no learning rate for step 8" in proc.stdout


def test_a_torchrun_command_run_at_one_rank_gets_the_ranks_environment_and_finishes(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    config = _command_run(tmp_path, "one-rank", "--local-rank")
    proc = cli("run", "one-rank", "--config", str(config), "--nproc-per-node", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "training run one-rank finished at step 20" in proc.stdout
    log = (Path(dagster_home) / "logs" / "run-one-rank.log").read_text()
    assert "local rank 0" in log


def test_a_world_size_that_is_not_a_number_is_one_line_and_exit_2(tmp_path, dagster_home,
                                                                   store_uri):
    proc = cli("run", "w", "--nproc-per-node", "abc")
    assert proc.returncode == Outcome.BAD_INPUT.exit_code
    (line,) = proc.stderr.strip().splitlines()
    assert "--nproc-per-node" in line and "'abc'" in line and "--help" in line, line
    assert "usage:" not in proc.stderr + proc.stdout


def test_an_attempt_relaunched_in_its_run_and_lost_with_its_run_worker_is_a_lineage_row(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    name = "lost-relaunch"
    config = _command_run(tmp_path, name, "--delay", "0.05", steps=400)
    with open(tmp_path / "run.log", "wb") as log:
        proc = subprocess.Popen([PYTHON, "-m", "ckpt_assets", "run", name, "--config",
                                 str(config)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        store = Path(store_uri)
        wait_for(lambda: (pointer_step(store, "default", name) or 0) >= 10, 300,
                 what="attempt 1 to commit step 10")
        first = read_heartbeat_pid(store, "default", name)
        os.kill(first, signal.SIGTERM)  # the trainer alone: relaunched in the same run
        wait_for(lambda: read_heartbeat_pid(store, "default", name) not in (None, first),
                 300, what="the trainer relaunched in the run")
        second = read_heartbeat_pid(store, "default", name)
        proc.kill()  # the run worker, with attempt 2 in it
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    wait_for(lambda: not pid_alive(second), 120, what="the orphaned trainer to exit")
    attempts = json.loads(cli("lineage", name, "--json").stdout)["attempts"]
    assert [a["attempt"] for a in attempts] == [1, 2], attempts
    assert [a["end"] for a in attempts] == ["preempted", "worker_lost"], attempts
    assert attempts[0]["decision"] == "relaunched in the same Dagster run"
    assert attempts[0]["dagster_run_id"] == attempts[1]["dagster_run_id"]
    text = cli("lineage", name).stdout
    assert "attempt 2: dagster run" in text and "worker lost" in text, text


def test_a_run_refused_before_its_trainer_starts_is_bad_input_in_its_summary_exit_and_list(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("a")
    config = _command_run(tmp_path, "no-data", dataset=str(data))
    assert cli("register", "no-data", "--config", str(config)).returncode == 0
    (data / "a.txt").unlink()
    data.rmdir()
    proc = cli("run", "no-data")
    assert proc.returncode == Outcome.BAD_INPUT.exit_code, proc.stdout + proc.stderr
    assert "attempt 1 of training run no-data ended bad_input (exit 2)" in proc.stdout
    assert f"dataset {data} does not exist" in proc.stdout
    (row,) = json.loads(cli("list", "--json").stdout)
    assert row["outcome"] == "bad_input"
