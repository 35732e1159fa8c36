"""FSDP2 (`fully_shard`) state through DCP: real ranks, real gloo, real signals.

The two-rank transformer of examples/fsdp under `python -m trainer.ranks`: rank 1 SIGKILLed
mid-run and the attempt resumed ends bitwise equal to an uninterrupted two-rank run (model,
optimizer, each rank's RNG and data position), its saves in the background; 2 -> 1 -> 4 ranks
reshard through DCP, the resharded state being exactly the checkpoint's and every
checkpoint at its global sample position. The toy task sharded by the trainer itself
(`distributed.strategy: fsdp`) resumes bitwise after a lost rank.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.rank_runs import (
    SLOW_STEPS,
    one_attempt,
    sharded_final,
    state_files,
    trainer_argv,
    wait_for_step,
)
from tests.trainer_proc import ROOT, assert_bitwise_equal, write_config
from trainer.checkpoints.repo import CheckpointRepo
from trainer.ranks.dcp_storage import shard_file
from trainer.storage import open_store

EXPERIMENT, RUN = "fsdp", "tiny"
EXAMPLE = str(ROOT / "examples" / "fsdp" / "fsdp_transformer.py")
KILLED = 128 + signal.SIGKILL
BATCHES_PER_EPOCH = (8192 - 1) // 16 // 16  # the example's windows of 16 in global batches of 16


def _ranks(nproc: int, store: Path, steps: int, log: Path, step_delay: float = 0,
           kill=None, script: list[str] | None = None, async_save: bool = False) -> int:
    """One attempt of `nproc` ranks of the example (or `script`); `kill(ranks)` once they run."""
    argv = script or [sys.executable, SLOW_STEPS, EXAMPLE, "--store", str(store), "--run", RUN,
                      "--steps", str(steps), "--every", "4",
                      *(["--async-save"] if async_save else [])]
    return one_attempt(argv, nproc, log, step_delay, kill)


def _repo(store: Path) -> CheckpointRepo:
    return CheckpointRepo(open_store(str(store)), EXPERIMENT, RUN)


def _final(store: Path) -> tuple[dict, list[dict]]:
    return sharded_final(store, EXPERIMENT, RUN)


@pytest.mark.slow
def test_fsdp_rank_1_killed_under_background_saves_then_resumed_ends_bitwise_equal_to_a_synchronous_uninterrupted_run(  # noqa: E501
        tmp_path):
    # async_save with sharded parts and two ranks: each save's shards copied on the
    # training thread, DCP's and the barrier's collectives on the save's own group. The
    # synchronous path with ranks is the Dagster test's (tests/e2e/test_ranks_dagster.py).
    ref, store, log = tmp_path / "ref", tmp_path / "store", tmp_path / "ranks.log"
    assert _ranks(2, ref, 24, log) == 0, log.read_text()[-3000:]

    def sigkill_rank1(launcher, ranks):
        wait_for_step(store, EXPERIMENT, RUN, 8, launcher)
        os.kill(ranks[1], signal.SIGKILL)

    assert _ranks(2, store, 24, log, 0.25, sigkill_rank1, async_save=True) == KILLED, \
        log.read_text()[-3000:]
    assert _ranks(2, store, 24, log, async_save=True) == 0, log.read_text()[-3000:]
    assert "resumed from" in log.read_text()
    (got, got_ranks), (want, want_ranks) = _final(store), _final(ref)
    assert set(got) == {"model", "optimizer"}
    assert_bitwise_equal(got, want, "sharded")
    for r, (g, w) in enumerate(zip(got_ranks, want_ranks, strict=True)):
        assert_bitwise_equal(g, w, f"rank {r}")


def _restored(nproc: int, store: Path, tmp_path: Path, log: Path) -> dict:
    """The whole state `nproc` ranks restore from `store`'s newest checkpoint (on a copy)."""
    copy, out = tmp_path / f"copy-{nproc}", tmp_path / f"restored-{nproc}.pt"
    shutil.copytree(store, copy)
    script = [sys.executable, str(ROOT / "tests" / "fsdp_restored.py"), str(copy), RUN, str(out)]
    assert _ranks(nproc, copy, 0, log, script=script) == 0, log.read_text()[-3000:]
    return torch.load(out, weights_only=True)


def _assert_restored_exactly(restored: dict, store: Path) -> None:
    saved, _ = _final(store)
    assert_bitwise_equal(restored["model"], saved["model"], "model")
    assert_bitwise_equal(restored["optimizer"]["state"], saved["optimizer"]["state"],
                         "optimizer")


@pytest.mark.slow
def test_fsdp_two_then_one_then_four_ranks_reshard_exactly_at_the_global_sample_position(
        tmp_path):
    # Each world size restores exactly what the one before it saved (four CPU ranks fit one
    # machine); 2 -> 1 -> 2 of a task through Dagster is tests/e2e/test_world_dagster.py's.
    store, log = tmp_path / "store", tmp_path / "ranks.log"
    assert _ranks(2, store, 8, log) == 0, log.read_text()[-3000:]
    repo = _repo(store)
    # Down to one rank (a process group of one), then up past where it started.
    for nproc, steps in ((1, 16), (4, 24)):
        _assert_restored_exactly(_restored(nproc, store, tmp_path, log), store)
        assert _ranks(nproc, store, steps, log) == 0, log.read_text()[-3000:]
        latest = repo.verify(repo.read_pointer().checkpoint)
        assert (latest.step, latest.meta.get("world_size", 1)) == (steps, nproc)
        assert {shard_file(r) for r in range(nproc)} <= set(latest.files)
        assert shard_file(nproc) not in latest.files
        for name in repo.committed():  # those retention kept
            manifest = repo.verify(name)
            first = store / repo.key(name, state_files(manifest)[0])
            data = torch.load(first, weights_only=True)["data"]
            assert data["epoch"] * BATCHES_PER_EPOCH + data["position"] == manifest.step
    losses = json.loads((store / repo.key(repo.read_pointer().checkpoint, "MANIFEST.json"))
                        .read_text())["meta"]["loss"]
    assert losses is not None and losses < 3.4  # ln(32): it learned across the reshards


# -- task mode: the toy task sharded by the trainer (distributed.strategy: fsdp) -------------

def _sigkill_rank_1_at(store: Path, step: int):
    def kill(launcher, ranks):
        wait_for_step(store, TASK_EXPERIMENT, TASK_RUN, step, launcher)
        os.kill(ranks[1], signal.SIGKILL)
    return kill


TASK_EXPERIMENT, TASK_RUN = "default", "equiv"  # tests.trainer_proc.write_config's


@pytest.mark.slow
def test_a_task_sharded_by_the_trainer_resumes_bitwise_after_a_lost_rank(tmp_path):
    # Its resumes at another world size (one plain process, then two ranks again) are
    # tests/e2e/test_world_dagster.py's, through Dagster.
    two = write_config(tmp_path / "fsdp-task.json", max_steps=32, eval_every=16,
                       checkpoint={"every_steps": 4, "keep_last": 2},
                       distributed={"nproc_per_node": 2, "strategy": "fsdp"})
    ref, store, log = tmp_path / "ref", tmp_path / "store", tmp_path / "task.log"
    argv = partial(trainer_argv, two)
    assert one_attempt(argv(str(ref)), 2, log) == 0, log.read_text()[-3000:]
    assert one_attempt(argv(str(store)), 2, log, 0.25, _sigkill_rank_1_at(store, 8)) == KILLED, \
        log.read_text()[-3000:]
    assert one_attempt(argv(str(store)), 2, log) == 0, log.read_text()[-3000:]
    (got, got_ranks), (want, want_ranks) = (sharded_final(s, TASK_EXPERIMENT, TASK_RUN)
                                            for s in (store, ref))
    assert set(got) == {"model", "optimizer"}  # the shards went through DCP
    assert_bitwise_equal(got, want, "sharded")
    for r, (g, w) in enumerate(zip(got_ranks, want_ranks, strict=True)):
        assert_bitwise_equal(g, w, f"rank {r}")
