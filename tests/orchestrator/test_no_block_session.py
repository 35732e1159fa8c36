"""The own-loop API without a `with` block, in real scripts: the session ends itself with the
block's exit codes, and speaks on stderr when the script configured no logging."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dagster_fixtures import *  # noqa: F403
from tests.trainer_proc import ROOT
from trainer.base.outcomes import Outcome
from trainer.checkpoints.repo import CheckpointRepo
from trainer.process.contract import Env
from trainer.storage import open_store

pytestmark = pytest.mark.slow

SCRIPT = '''\
import logging, os
import torch
from trainer import CheckpointSession

mode = os.environ["MODE"]
if mode == "logging":
    logging.basicConfig(level=logging.INFO, format="LOG %(name)s: %(message)s")
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
parts = {"bad": [1, 2]} if mode == "bad_part" else {}
ckpt = CheckpointSession(run="r", experiment="e", max_steps=12, every_steps=4)
start = ckpt.restore(model=model, optimizer=opt, **parts)
for step in range(start + 1, 11):  # stops short of max_steps: the exit commits step 10
    loss = model(torch.ones(2, 3)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if mode == "bug" and step == 6:
        raise ValueError("a bug at step 6")
    if mode == "nan" and step == 6:
        loss = loss * float("nan")
    ckpt.step(step, loss=loss)
print("after the loop", flush=True)
'''


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "DAGSTER_PIPES"))}
    env.update({"PYTHONPATH": str(ROOT), "MODE": mode, Env.STORE_URI: str(tmp_path / "store"),
                "OMP_NUM_THREADS": "1"})
    return subprocess.run([sys.executable, "-W", "error::UserWarning", str(script)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


def _repo(tmp_path: Path) -> CheckpointRepo:
    return CheckpointRepo(open_store(str(tmp_path / "store")), "e", "r")


def test_a_script_without_logging_configuration_prints_the_sessions_lines_and_commits_its_last_step_at_exit(tmp_path):
    first = _run(tmp_path, "plain")
    assert first.returncode == 0, first.stderr
    assert "trainer: starting e/r from scratch" in first.stderr
    assert "trainer: checkpoint committed: step 4," in first.stderr
    assert "after the loop" in first.stdout
    repo = _repo(tmp_path)
    latest = repo.read_manifest(repo.read_pointer().checkpoint)
    assert (latest.step, latest.meta["reason"]) == (10, "final")
    assert "trainer: training finished at step 10" in first.stderr

    again = _run(tmp_path, "plain")  # a finished run is done: nothing more is trained
    assert again.returncode == 0, again.stderr
    assert f"trainer: e/r already finished at step 10 ({repo.uri(latest.name)})" in again.stderr
    assert "after the loop" not in again.stdout


def test_a_script_that_configured_logging_gets_each_line_once_through_it(tmp_path):
    res = _run(tmp_path, "logging")
    assert res.returncode == 0, res.stderr
    assert res.stderr.count("checkpoint committed: step 4,") == 1, res.stderr
    assert "LOG trainer: checkpoint committed: step 4," in res.stderr
    assert "trainer: starting" not in res.stderr.replace("LOG trainer: starting", "")


@pytest.mark.parametrize("mode, outcome", [
    ("bug", Outcome.USER_CODE_ERROR),
    ("nan", Outcome.DIVERGED),
    ("bad_part", Outcome.BAD_INPUT),
])
def test_without_a_block_a_failure_exits_with_the_blocks_code_reported_once_and_commits_no_final_step(
        tmp_path, mode, outcome):
    res = _run(tmp_path, mode)
    assert res.returncode == outcome.exit_code, res.stderr
    assert "after the loop" not in res.stdout
    assert "training finished" not in res.stderr
    assert res.stderr.count("Traceback") == (1 if outcome is Outcome.USER_CODE_ERROR else 0), \
        res.stderr
    if mode != "bad_part":
        assert _repo(tmp_path).read_pointer().step == 4  # the last trigger, not a final commit
    else:
        assert "without state_dict()/load_state_dict()" in res.stderr


def test_the_no_block_example_runs_under_dagster_as_a_command_and_a_second_launch_resumes_it(
        instance, tmp_path, mlflow_uri):
    """The last step of the README's "Your script in five minutes"."""
    from ckpt_assets.definitions import make_resources
    from tests.dagster_fixtures import checkpoints, materialize_run, step_failure_metadata
    from trainer.config_file import read_config_file

    store = str(tmp_path / "s")
    cfg = read_config_file(ROOT / "examples" / "no_block" / "run.yaml")
    res = materialize_run(instance, "spirals-1", make_resources(store), training=cfg)
    assert res.success, step_failure_metadata(res)
    steps = [c["step"] for c in checkpoints(res)]
    assert steps[:4] == [10, 20, 30, 32] and steps[-1] == 192  # every 10, and each epoch end
    again = materialize_run(instance, "spirals-1", make_resources(store))
    assert again.success, step_failure_metadata(again)
    logs = "\n".join(e.user_message for e in instance.all_logs(again.run_id))
    assert "spirals/spirals-1 already finished at step 192" in logs  # and trains nothing
    assert "spirals/spirals-1/checkpoints/step-000000192" in logs
