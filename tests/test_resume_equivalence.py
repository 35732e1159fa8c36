"""The headline invariant: interrupted and resumed == never interrupted, bit for bit."""

from __future__ import annotations

import signal

import pytest

from tests.trainer_proc import (
    assert_bitwise_equal,
    final_state,
    run_trainer,
    training_state,
    write_config,
)

pytestmark = pytest.mark.slow

# (step after which the signal is sent, signal). 1024 samples / 32 = 32 batches per epoch,
# checkpoints every 20 steps: these land mid-epoch, right after an epoch end, and between
# checkpoints, so every resume has to skip into the middle of a shuffled epoch.
KILL_CHAIN = [(13, signal.SIGKILL), (45, signal.SIGKILL), (70, signal.SIGKILL)]
TERM_CHAIN = [(7, signal.SIGTERM), (33, signal.SIGINT), (77, signal.SIGTERM)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("baseline")
    cfg = write_config(d / "cfg.json")
    res = run_trainer(cfg, str(d / "store"))
    assert res.returncode == 0, res.log
    return training_state(final_state(d / "store"))


def _interrupted_run(tmp_path, store_uri, store_dir_or_loader, chain, task_delay=0.01):
    cfg = write_config(tmp_path / "cfg.json")
    slow_cfg = write_config(tmp_path / "slow.json", task_args={"n_train": 1024, "hidden": 48,
                                                             "step_delay": task_delay})
    for at, sig in chain:
        res = run_trainer(slow_cfg, store_uri, "--resume", "auto", interrupt_at=at, sig=sig)
        expected = -signal.SIGKILL if sig == signal.SIGKILL else 143
        assert res.returncode == expected, res.log
        if sig != signal.SIGKILL:
            # A stop request commits the step it stopped at: no work lost.
            assert res.committed and res.committed[-1] >= at, res.log
    # The last attempt runs at full speed with the plain config: the delay is not state.
    res = run_trainer(cfg, store_uri, "--resume", "auto")
    assert res.returncode == 0, res.log
    assert "resumed from" in res.log
    return training_state(store_dir_or_loader())


def test_sigkill_at_several_steps_then_resume_matches_uninterrupted_run_bitwise(
        tmp_path, uninterrupted):
    store = tmp_path / "store"
    got = _interrupted_run(tmp_path, str(store), lambda: final_state(store), KILL_CHAIN)
    assert_bitwise_equal(uninterrupted, got)


def test_sigterm_and_sigint_commit_and_exit_143_and_resume_matches_bitwise(
        tmp_path, uninterrupted):
    store = tmp_path / "store"
    got = _interrupted_run(tmp_path, str(store), lambda: final_state(store), TERM_CHAIN)
    assert_bitwise_equal(uninterrupted, got)


def test_interrupted_run_on_s3_resumes_bitwise_identical(tmp_path, uninterrupted, s3_env):
    from tests.s3_state import final_state_s3

    uri = s3_env["uri"]
    chain = [(13, signal.SIGKILL), (52, signal.SIGTERM)]
    got = _interrupted_run(tmp_path, uri, lambda: final_state_s3(uri), chain)
    assert_bitwise_equal(uninterrupted, got)
