"""Task mode, widened: the task's own optimizer and scheduler, bf16 autocast on CPU,
gradient accumulation, DataLoader workers and in-order data, all resumed bit for bit."""

from __future__ import annotations

import logging
import signal

import pytest
import torch

from tests.trainer_proc import (
    assert_bitwise_equal,
    final_state,
    run_trainer,
    training_state,
    write_config,
)
from trainer.base.errors import ConfigError
from trainer.device import resolve_device

WIDE = {"task": "tests.user_tasks:own_optimizer", "task_args": {"n": 512},
        "amp": {"dtype": "bfloat16"}, "grad_accum_steps": 2,
        "data": {"num_workers": 2, "shuffle": False}, "max_steps": 60, "eval_every": 20,
        "checkpoint": {"every_steps": 10, "keep_last": 2}}


def test_device_auto_on_a_cpu_only_machine_picks_the_cpu_and_says_so(caplog):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with caplog.at_level(logging.INFO, "trainer"):
        assert resolve_device("auto") == torch.device("cpu")
    assert "no CUDA device available, using CPU" in caplog.text


@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
def test_asking_for_cuda_without_it_is_bad_input(spec):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ConfigError, match="no CUDA device"):
        resolve_device(spec)


def test_an_unknown_device_is_bad_input():
    with pytest.raises(ConfigError, match="use auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")


@pytest.mark.slow
def test_bf16_accumulation_workers_and_the_tasks_optimizer_resume_bitwise(tmp_path):
    base = write_config(tmp_path / "wide.json", run="wide", **WIDE)
    res = run_trainer(base, str(tmp_path / "a"))
    assert res.returncode == 0, res.log
    for at, sig in [(17, signal.SIGKILL), (38, signal.SIGTERM)]:
        res = run_trainer(base, str(tmp_path / "b"), interrupt_at=at, sig=sig)
        assert res.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 143), res.log
    res = run_trainer(base, str(tmp_path / "b"))
    assert res.returncode == 0 and "resumed from" in res.log, res.log
    a = final_state(tmp_path / "a", run="wide")
    b = final_state(tmp_path / "b", run="wide")
    assert_bitwise_equal(training_state(a), training_state(b))
    # Two batches per step, in order: after 60 steps the loader is 120 batches in.
    assert (a["data"]["epoch"], a["data"]["position"]) == divmod(120, 512 // 32)
    assert a["optimizer"]["param_groups"][0]["momentum"] == 0.9  # the task's SGD
    assert a["scheduler"]["step_size"] == 15  # the task's StepLR


@pytest.mark.slow
def test_float16_without_cuda_keeps_a_grad_scaler_part_and_resumes(tmp_path):
    cfg = write_config(tmp_path / "fp16.json", run="fp16", max_steps=30,
                       amp={"dtype": "float16"}, checkpoint={"every_steps": 10})
    res = run_trainer(cfg, str(tmp_path / "s"), interrupt_at=14, sig=signal.SIGKILL)
    assert res.returncode == -signal.SIGKILL
    res = run_trainer(cfg, str(tmp_path / "s"))
    assert res.returncode == 0 and "resumed from" in res.log, res.log
    assert final_state(tmp_path / "s", run="fp16")["scaler"]["scale"] > 0


@pytest.mark.slow
def test_lbfgs_a_closure_optimizer_trains_in_task_mode_and_resumes_bitwise(tmp_path):
    cfg = write_config(tmp_path / "lbfgs.json", run="lbfgs", task="tests.user_tasks:lbfgs",
                       task_args={"n": 256}, max_steps=30, eval_every=10,
                       checkpoint={"every_steps": 10, "keep_last": 2})
    res = run_trainer(cfg, str(tmp_path / "a"))
    assert res.returncode == 0, res.log
    res = run_trainer(cfg, str(tmp_path / "b"), interrupt_at=14, sig=signal.SIGTERM)
    assert res.returncode == 143 and res.committed[-1] >= 14, res.log
    res = run_trainer(cfg, str(tmp_path / "b"))
    assert res.returncode == 0 and "resumed from" in res.log, res.log
    a = final_state(tmp_path / "a", run="lbfgs")
    b = final_state(tmp_path / "b", run="lbfgs")
    assert_bitwise_equal(training_state(a), training_state(b))
    history = a["optimizer"]["state"][0]
    assert len(history["old_dirs"]) == 8 and history["n_iter"] > 30  # several per step


def test_a_closure_optimizer_with_a_float16_grad_scaler_is_refused_naming_it_and_the_own_loop():
    from trainer.config import config_from_dict
    from trainer.loop import check_closure_fits

    model = torch.nn.Linear(2, 1)
    lbfgs = torch.optim.LBFGS(model.parameters())
    cfg = config_from_dict({"task": "tests.user_tasks:lbfgs", "amp": {"dtype": "float16"}})
    with pytest.raises(ConfigError, match="LBFGS.step needs a closure.*CheckpointSession"):
        check_closure_fits(cfg, lbfgs, torch.amp.GradScaler("cpu", enabled=True))
    assert check_closure_fits(cfg, lbfgs, torch.amp.GradScaler("cpu", enabled=False)) is True
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert check_closure_fits(cfg, sgd, torch.amp.GradScaler("cpu", enabled=True)) is False


@pytest.mark.slow
def test_lbfgs_with_float16_in_task_mode_exits_2_before_anything_is_committed(tmp_path):
    cfg = write_config(tmp_path / "fp16.json", run="lbfgs16", task="tests.user_tasks:lbfgs",
                       amp={"dtype": "float16"})
    res = run_trainer(cfg, str(tmp_path / "s"))
    assert res.returncode == 2, res.log
    assert "LBFGS.step needs a closure" in res.log and not res.committed
