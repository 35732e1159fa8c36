"""Two-rank DDP training through Dagster: a real dagster-daemon resumes it as one job.

Task mode (the trainer's DDP loop) and command mode (examples/ddp/ddp_digits.py calling
`CheckpointSession` on every rank) run under `model_checkpoint` with
`distributed.nproc_per_node: 2`: torchrun through `python -m trainer.ranks`. The task is
interrupted three ways (SIGKILL of rank 1, SIGTERM of rank 0, SIGKILL of torchrun itself),
the command once (SIGKILL of rank 1), each at a seeded step; the sensors resume each
failure exactly once, and the final parameters of every rank are bitwise those of an
uninterrupted two-rank run. The in-run relaunch is off here: these are the sensors' resumes.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.daemon_harness import ROOT, Daemon, kill, trainer_parent, training_config
from tests.polling import wait_for
from tests.rank_runs import env, gone, ranks_under
from trainer.distributed import rank_file

pytestmark = pytest.mark.slow

RNG = random.Random(20261201)
TWO_RANKS = {"nproc_per_node": 2}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from ckpt_assets.runs.settings import Setting

    work = tmp_path_factory.mktemp("ranks-e2e")
    d = Daemon.start(work, str(work / "store"), extra_env={Setting.IN_RUN_RELAUNCH: "0"})
    yield d
    d.stop()


def _rank_states(store: Path, experiment: str, run: str) -> list[dict]:
    ckdir = store / experiment / run / "checkpoints"
    name = json.loads((ckdir / "latest.json").read_text())["checkpoint"]
    return [torch.load(ckdir / name / rank_file(r), weights_only=True) for r in range(2)]


def _standalone(argv: list[str], store: Path) -> list[dict]:
    """The same training, two ranks, uninterrupted, outside Dagster."""
    res = subprocess.run([sys.executable, "-m", "trainer.ranks", "--nproc-per-node", "2", "--",
                          *argv], cwd=ROOT, env=env(0), capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def _ranks_of_attempt(daemon: Daemon, run: str, step: int, attempt: int) -> tuple[int, dict]:
    """(launcher pid, rank -> pid) of the attempt, once it has reached `step`."""
    hb = daemon.wait_for_step(run, step, attempt=attempt)
    launcher = trainer_parent(hb["pid"])  # rank 0 beats; its parent is torchrun
    ranks = wait_for(lambda: (r := ranks_under(launcher)) and len(r) == 2 and r, 60,
                     what="two ranks under the launcher")
    return launcher, ranks


def _resumed_once_each(daemon: Daemon, run: str, failed_runs: int) -> None:
    final = daemon.wait_done(run, timeout=600)
    runs = daemon.runs(run)
    assert len(runs) == failed_runs + 1, [(r.run_id[:8], r.status.value) for r in runs]
    for failed in runs[:-1]:
        resumes = [r for r in daemon.instance.get_runs()
                   if r.tags.get("ckpt/parent_run_id") == failed.run_id]
        assert len(resumes) == 1 and failed.tags.get("ckpt/decision") == "resume"
    assert final.tags["ckpt/attempt"] == str(failed_runs + 1)
    assert daemon.max_active[run] == 1


def _three_kills(daemon: Daemon, run: str, steps: list[int]) -> None:
    """SIGKILL of rank 1, SIGTERM of rank 0, SIGKILL of torchrun itself, at the seeded
    steps of attempts 1, 2 and 3; each failure resumed once by the sensors."""
    _, ranks = _ranks_of_attempt(daemon, run, steps[0], attempt=1)
    kill(ranks[1], signal.SIGKILL)
    _, ranks = _ranks_of_attempt(daemon, run, steps[1], attempt=2)
    kill(ranks[0], signal.SIGTERM)
    launcher, ranks = _ranks_of_attempt(daemon, run, steps[2], attempt=3)
    kill(launcher, signal.SIGKILL)
    gone(list(ranks.values()))  # its ranks commit and exit with it
    _resumed_once_each(daemon, run, failed_runs=3)
    kinds = [r.tags.get("ckpt/failure_kind") for r in daemon.runs(run)[:-1]]
    assert kinds == ["killed", "preempted", "killed"], kinds


def _assert_same_ranks(got: list[dict], want: list[dict]) -> None:
    from tests.trainer_proc import assert_bitwise_equal

    for r, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(w, g, f"rank {r}")


def test_two_rank_ddp_task_killed_three_ways_is_resumed_once_each_and_ends_bitwise_equal(
        daemon, tmp_path):
    config = training_config("ddp-task", distributed=TWO_RANKS,
                             task_args={"step_delay": 0.05})
    base = dict(config, task_args={k: v for k, v in config["task_args"].items()
                                   if k != "step_delay"})
    (tmp_path / "base.json").write_text(json.dumps(base))
    _standalone([sys.executable, "-m", "trainer", "--config", str(tmp_path / "base.json"),
                 "--store", str(tmp_path / "base")], tmp_path / "base")
    want = _rank_states(tmp_path / "base", "default", "ddp-task")

    daemon.launch("ddp-task", config, tmp_path)
    _three_kills(daemon, "ddp-task", sorted(RNG.sample(range(12, 52), 3)))
    _assert_same_ranks(_rank_states(Path(daemon.store), "default", "ddp-task"), want)


def test_a_two_rank_command_whose_rank_1_is_sigkilled_is_resumed_once_and_ends_bitwise_equal(
        daemon, tmp_path):
    # The three ways are the task's test above; this one is about a user's script: the
    # same launch and resume of its ranks, through its own `CheckpointSession`.
    argv = ["examples/ddp/ddp_digits.py", "--steps", "140", "--run", "ddp-cmd"]
    _standalone([sys.executable, *argv, "--store", str(tmp_path / "base")], tmp_path / "base")
    want = _rank_states(tmp_path / "base", "digits", "ddp-cmd")
    config = {"command": ["python", "tests/slow_steps.py", *argv], "max_steps": 140,
              "env": {"STEP_DELAY": "0.05"}, "distributed": TWO_RANKS,
              "checkpoint": {"heartbeat_seconds": 0.05}}
    daemon.launch("ddp-cmd", config, tmp_path)
    # After a commit (every 20 steps), so the resume is handed a checkpoint.
    _, ranks = _ranks_of_attempt(daemon, "ddp-cmd", RNG.randint(25, 125), attempt=1)
    kill(ranks[1], signal.SIGKILL)
    _resumed_once_each(daemon, "ddp-cmd", failed_runs=1)
    _assert_same_ranks(_rank_states(Path(daemon.store), "default", "ddp-cmd"), want)
