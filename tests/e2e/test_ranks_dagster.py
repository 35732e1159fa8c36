"""Two-rank DDP training through Dagster: a real dagster-daemon resumes it as one job.

Task mode (the trainer's DDP loop) and command mode (examples/fsdp: a transformer sharded
with FSDP2, `CheckpointSession` on every rank saving it through DCP) run under
`model_checkpoint` through `python -m trainer.ranks` (torchrun). The command runs two ranks
on one node (`distributed.nproc_per_node: 2`) and is interrupted three ways (SIGKILL of rank
1, SIGTERM of rank 0, SIGKILL of torchrun itself); the task runs one rank on each of two
nodes (`nnodes: 2`, no endpoint: the attempt starts both on this machine) and loses the node
that does not hold rank 0 (SIGKILL of its launcher). Each is interrupted at a seeded step;
the sensors resume each failure exactly once, and the final state (every rank's file, and
the sharded model and optimizer read back whole) is bitwise that of an uninterrupted
two-rank run on one node. The in-run relaunch is off here: these are the sensors' resumes.
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

from ckpt_assets.defs.io_managers import load_checkpoint_state
from tests.daemon_harness import ROOT, Daemon, kill, trainer_parent, training_config
from tests.polling import wait_for
from tests.rank_runs import children, env, gone, ranks_under, sharded_final
from trainer.ranks.distributed import rank_file
from trainer.storage import open_store

pytestmark = pytest.mark.slow

RNG = random.Random(20261201)
TWO_RANKS = {"nproc_per_node": 2}
TWO_NODES = {"nproc_per_node": 1, "nnodes": 2}


@pytest.fixture
def daemon(sensors_daemon):
    """The shared daemon for the sensors' resumes (tests/e2e/conftest.py)."""
    return sensors_daemon.get()


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


def _assert_same_ranks(got: list[dict], want: list[dict]) -> None:
    from tests.trainer_proc import assert_bitwise_equal

    for r, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(w, g, f"rank {r}")


def _other_node(daemon: Daemon, run: str, step: int) -> tuple[int, int]:
    """(launcher pid, rank pid) of the node that does not hold rank 0, once the attempt has
    reached `step`: the attempt's launcher started every node's launcher, rank 0 beats."""
    hb = daemon.wait_for_step(run, step, attempt=1)
    node0 = trainer_parent(hb["pid"])
    other = wait_for(lambda: [n for n in children(trainer_parent(node0)) if n != node0], 60,
                     what="the other node's launcher")
    rank = wait_for(lambda: ranks_under(other[0]), 60, what="the other node's rank")
    return other[0], next(iter(rank.values()))


def test_a_two_node_ddp_task_that_loses_a_node_is_resumed_once_and_ends_bitwise_equal(
        daemon, tmp_path):
    # The three ways are the sharded command's below, and the DDP task's own standalone
    # (tests/standalone/test_ranks.py); this one is task mode's launch and resume of ranks,
    # on two nodes: a node lost is a machine lost, the attempt ends killed.
    step = RNG.randint(12, 52)
    base = training_config("ddp-task", distributed=TWO_RANKS)
    base["task_args"].pop("step_delay")
    # Both ranks of the first attempt are held after the drawn step until it is interrupted.
    config = dict(base, distributed=TWO_NODES,
                  task_args={**base["task_args"], "pause_after_step": step})
    (tmp_path / "base.json").write_text(json.dumps(base))
    _standalone([sys.executable, "-m", "trainer", "--config", str(tmp_path / "base.json"),
                 "--store", str(tmp_path / "base")], tmp_path / "base")
    want = _rank_states(tmp_path / "base", "default", "ddp-task")

    daemon.launch("ddp-task", config, tmp_path)
    launcher, rank = _other_node(daemon, "ddp-task", step)
    kill(launcher, signal.SIGKILL)
    gone([rank])
    _resumed_once_each(daemon, "ddp-task", failed_runs=1)
    assert daemon.runs("ddp-task")[0].tags.get("ckpt/failure_kind") == "killed"
    _assert_same_ranks(_rank_states(Path(daemon.store), "default", "ddp-task"), want)


def test_a_two_rank_fsdp2_command_whose_rank_is_sigkilled_is_resumed_once_and_ends_bitwise_equal(
        daemon, tmp_path):
    """examples/fsdp: a transformer sharded with FSDP2, its state saved through DCP, its
    ranks started by the orchestrator and the failure resumed by the sensors. The run's
    working directory is a project's with a `trainer.py` of its own, which the ranks
    launcher, started there with `python -m`, never takes for this package. How each way
    of losing a rank ends (SIGKILL, SIGTERM, its launcher killed) is proven once, without
    Dagster, in tests/standalone/test_ranks.py; a lost node under Dagster just above."""
    argv = [str(ROOT / "examples/fsdp/fsdp_transformer.py"), "--steps", "48", "--every", "4",
            "--run", "fsdp"]
    _standalone([sys.executable, *argv, "--store", str(tmp_path / "base")], tmp_path / "base")
    want, want_ranks = sharded_final(tmp_path / "base", "fsdp", "fsdp")
    project = tmp_path / "project"
    project.mkdir()
    (project / "trainer.py").write_text("class Trainer:  # the project's own\n    pass\n")
    config = {"command": ["python", str(ROOT / "tests/slow_steps.py"), *argv], "max_steps": 48,
              "cwd": str(project), "env": {"STEP_DELAY": "0.1"}, "distributed": TWO_RANKS,
              "checkpoint": {"heartbeat_seconds": 0.05}}
    daemon.launch("fsdp", config, tmp_path)
    # After a commit (every 4 steps), so the resume is handed a checkpoint.
    _, ranks = _ranks_of_attempt(daemon, "fsdp", RNG.randint(6, 30), attempt=1)
    kill(ranks[1], signal.SIGKILL)
    _resumed_once_each(daemon, "fsdp", failed_runs=1)
    assert daemon.runs("fsdp")[0].tags.get("ckpt/failure_kind") == "killed"
    got, got_ranks = sharded_final(Path(daemon.store), "default", "fsdp")
    assert set(got) == {"model", "optimizer"}
    _assert_same_ranks([got], [want])
    _assert_same_ranks(got_ranks, want_ranks)
    # What `final_model` was handed (the run succeeded: it exported it): the shards whole.
    handed = load_checkpoint_state(open_store(daemon.store), "default", "fsdp")
    _assert_same_ranks([handed["model"]], [want["model"]])
