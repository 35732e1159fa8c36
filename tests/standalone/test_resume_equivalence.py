"""The headline invariant: interrupted and resumed == never interrupted, bit for bit.

On the local store here; on S3, through the daemon, in tests/e2e/test_auto_resume_s3_e2e.py."""

from __future__ import annotations

import signal

import pytest

from tests.trainer_proc import (
    assert_bitwise_equal,
    config_dict,
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
    assert_bitwise_equal(uninterrupted(config_dict()), got)


def test_sigterm_and_sigint_commit_and_exit_143_and_resume_matches_bitwise(
        tmp_path, uninterrupted):
    store = tmp_path / "store"
    got = _interrupted_run(tmp_path, str(store), lambda: final_state(store), TERM_CHAIN)
    assert_bitwise_equal(uninterrupted(config_dict()), got)


def test_a_user_task_with_its_own_stateful_parts_and_values_resumes_bitwise(tmp_path):
    import torch

    args = {"task": "trainer.tasks.regression:build", "task_args": {"n": 512}}
    base = write_config(tmp_path / "base.json", run="user", **args)
    res = run_trainer(base, str(tmp_path / "a"))
    assert res.returncode == 0, res.log
    slow = write_config(tmp_path / "slow.json", run="user", task="trainer.tasks.regression:build",
                        task_args={"n": 512})
    res = run_trainer(slow, str(tmp_path / "b"), interrupt_at=37, sig=signal.SIGKILL)
    assert res.returncode == -signal.SIGKILL
    res = run_trainer(base, str(tmp_path / "b"))
    assert res.returncode == 0 and "resumed from" in res.log
    a = final_state(tmp_path / "a", run="user")
    b = final_state(tmp_path / "b", run="user")
    assert_bitwise_equal(training_state(a), training_state(b))
    assert a["curriculum"] == b["curriculum"] and a["curriculum"]["level"] < 0.5
    assert a["task_values"] == b["task_values"]
    assert torch.is_tensor(a["loop"]["losses"])


def test_background_saves_interrupted_by_sigkill_resume_bitwise_identical(tmp_path, uninterrupted):
    store = tmp_path / "store"
    cfg = write_config(tmp_path / "async.json", checkpoint={"async_save": True})
    slow = write_config(tmp_path / "async-slow.json", checkpoint={"async_save": True},
                        task_args={"n_train": 1024, "hidden": 48, "step_delay": 0.01})
    res = run_trainer(slow, str(store), interrupt_at=47, sig=signal.SIGKILL)
    assert res.returncode == -signal.SIGKILL
    res = run_trainer(cfg, str(store))
    assert res.returncode == 0 and "resumed from" in res.log, res.log
    assert_bitwise_equal(uninterrupted(config_dict()), training_state(final_state(store)))
