"""Several ranks checkpoint and resume as one attempt.

Fast: the launcher's exit code is the cause among the ranks' exits (not the echoes), a lost
rank's report never hides a bug, the global batch splits over the ranks without a sample
lost or repeated, a bad rendezvous is refused.

Slow (real processes, real gloo, real signals): two ranks under `python -m trainer.ranks`
killed three ways (SIGKILL of rank 1, SIGTERM of rank 0, SIGKILL of the launcher itself)
end bitwise equal to an uninterrupted two-rank run; 2 -> 1 -> 2 ranks continues at the global
sample position; a rank killed inside a save's barrier never leaves a checkpoint (30 trials).
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch

from tests.rank_runs import (
    env,
    gone,
    pointer_step,
    rank_pids,
    start_torchrun,
    trainer_argv,
    wait_for_step,
)
from tests.trainer_proc import assert_bitwise_equal, write_config
from trainer.data import ResumableLoader
from trainer.distributed import rank_file
from trainer.outcomes import Outcome
from trainer.ranks import attempt_exit, parse

KILLED = 128 + signal.SIGKILL
PREEMPTED = Outcome.PREEMPTED.exit_code
LOST = Outcome.RANK_LOST.exit_code


# -- fast ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("codes", "expected"), [
    ({1: -signal.SIGKILL, 0: LOST}, KILLED),  # the peer's death, not rank 0's echo of it
    ({0: -signal.SIGKILL, 1: PREEMPTED}, KILLED),
    ({1: Outcome.USER_CODE_ERROR.exit_code, 0: LOST}, Outcome.USER_CODE_ERROR.exit_code),
    ({0: LOST, 1: Outcome.BAD_INPUT.exit_code}, Outcome.BAD_INPUT.exit_code),
    ({0: PREEMPTED, 1: PREEMPTED}, PREEMPTED),
    ({0: -signal.SIGTERM, 1: PREEMPTED}, PREEMPTED),
    ({0: LOST}, LOST),
    ({0: PREEMPTED, 1: LOST}, LOST),
])
def test_the_launcher_exits_with_the_cause_among_the_ranks_not_an_echo(codes, expected):
    assert attempt_exit(codes) == expected


def test_a_lost_ranks_report_never_hides_the_cause_the_exit_status_names():
    lost = Outcome.RANK_LOST.value
    assert Outcome.of_exit(Outcome.RANK_LOST.exit_code, lost) is Outcome.RANK_LOST
    assert Outcome.of_exit(1, lost) is Outcome.USER_CODE_ERROR
    assert Outcome.of_exit(KILLED, lost) is Outcome.KILLED_BY_SIGNAL
    assert Outcome.RANK_LOST.kind.resumable


def test_the_global_batch_splits_over_the_ranks_with_no_sample_lost_or_repeated():
    data = list(range(64))
    whole = ResumableLoader(data, 8, seed=3)
    halves = [ResumableLoader(data, 8, seed=3, rank=r, world=2) for r in range(2)]
    for _ in range(10):  # across an epoch boundary
        expected = next(iter_of(whole)).tolist()
        got = [next(iter_of(h)).tolist() for h in halves]
        assert got[0] + got[1] == expected
    assert {h.state_dict()["position"] for h in halves} == {whole.state_dict()["position"]}


_iters: dict[int, object] = {}


def iter_of(loader: ResumableLoader):
    return _iters.setdefault(id(loader), loader.batches())


def test_a_global_batch_that_does_not_split_evenly_is_refused_naming_the_multiple():
    with pytest.raises(ValueError, match="multiple of 3"):
        ResumableLoader(list(range(64)), 8, rank=0, world=3)


def test_several_nodes_without_a_rendezvous_are_refused_with_what_to_pass():
    with pytest.raises(SystemExit):
        parse(["--nproc-per-node", "2", "--nnodes", "2", "--", "python", "x.py"])


# -- slow: real ranks ------------------------------------------------------------------------

EXPERIMENT, RUN = "default", "equiv"


def _config(tmp_path: Path, name: str, nproc: int) -> Path:
    return write_config(tmp_path / f"{name}.json", max_steps=60, eval_every=20,
                        checkpoint={"every_steps": 4, "keep_last": 2},
                        distributed={"nproc_per_node": nproc})


def _rank_states(store: Path) -> list[dict]:
    ckdir = store / EXPERIMENT / RUN / "checkpoints"
    name = json.loads((ckdir / "latest.json").read_text())["checkpoint"]
    return [torch.load(ckdir / name / rank_file(r), weights_only=True) for r in range(2)]


def _run(config: Path, store: Path, log: Path, kill=None, step_delay: float = 0.05) -> int:
    """One attempt of two ranks; `kill(launcher, ranks)` once the pointer is at its step."""
    launcher = start_torchrun(trainer_argv(config, str(store)), 2, env(step_delay), log)
    try:
        if kill is not None:
            kill(launcher, rank_pids(launcher, 2))
        return launcher.wait(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.slow
def test_two_ranks_killed_three_ways_end_bitwise_equal_to_an_uninterrupted_two_rank_run(
        tmp_path):
    rng = random.Random(17)
    config = _config(tmp_path, "two", 2)
    ref, store = tmp_path / "ref", tmp_path / "store"
    log = tmp_path / "ranks.log"
    assert _run(config, ref, log, step_delay=0) == 0, log.read_text()[-3000:]

    def at(step: int, what):
        def kill(launcher, ranks):
            wait_for_step(store, EXPERIMENT, RUN, step, launcher)
            what(launcher, ranks)
        return kill

    k1, k2, k3 = sorted(rng.sample(range(4, 56, 4), 3))
    sigkill_rank1 = at(k1, lambda _l, r: os.kill(r[1], signal.SIGKILL))
    assert _run(config, store, log, sigkill_rank1) == KILLED, log.read_text()[-3000:]
    sigterm_rank0 = at(k2, lambda _l, r: os.kill(r[0], signal.SIGTERM))
    assert _run(config, store, log, sigterm_rank0) == PREEMPTED, log.read_text()[-3000:]
    stopped_at = pointer_step(store, EXPERIMENT, RUN)
    assert stopped_at >= k2  # the stop committed the step both ranks agreed on

    ranks_of_killed_launcher: list[int] = []

    def sigkill_launcher(launcher, ranks):
        wait_for_step(store, EXPERIMENT, RUN, max(k3, stopped_at + 4), launcher)
        ranks_of_killed_launcher.extend(ranks.values())
        launcher.send_signal(signal.SIGKILL)

    assert _run(config, store, log, sigkill_launcher) == -signal.SIGKILL
    gone(ranks_of_killed_launcher)  # the orphaned ranks commit and exit with their launcher
    assert _run(config, store, log) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert text.count("resumed from") >= 3
    for r, (got, want) in enumerate(zip(_rank_states(store), _rank_states(ref), strict=True)):
        assert_bitwise_equal(got, want, f"rank {r}")
