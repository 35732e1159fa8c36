"""Values a user got wrong are bad input (exit 2, naming what was wrong), never a bug (1)
nor a storage fault (5): steps that do not increase, and config values torch cannot take."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer_proc import ROOT, run_trainer, write_config
from trainer.api.session import CheckpointSession
from trainer.api.state_files import load_verified_state
from trainer.base.errors import ConfigError
from trainer.base.outcomes import Outcome
from trainer.checkpoints.manifest import MAX_STEP
from trainer.checkpoints.repo import CheckpointRepo
from trainer.config import (
    MAX_LR,
    MAX_PARALLEL,
    MAX_SEED,
    MAX_WEIGHT_DECAY,
    OptimConfig,
    TrainConfig,
    config_from_dict,
)
from trainer.loop import default_optimizer, seed_everything
from trainer.storage import open_store

# -- steps ---------------------------------------------------------------------------------


def _repo(store: Path) -> CheckpointRepo:
    return CheckpointRepo(open_store(str(store)), "e", "r")


def _steps_in_process(store: Path, steps: list, caplog) -> int:
    ckpt = CheckpointSession(run="r", experiment="e", store=str(store), install_signals=False,
                             every_steps=10, heartbeat_seconds=60)
    with caplog.at_level(logging.ERROR, "trainer"), pytest.raises(SystemExit) as exc, ckpt:
        ckpt.restore(model=torch.nn.Linear(2, 2))
        for s in steps:
            ckpt.step(s, loss=1.0)
    return exc.value.code


@pytest.mark.parametrize("steps, message", [
    ([10, 20, 10], "step 10 after 20: steps must increase"),
    ([10, 20, 20], "step 20 after 20: steps must increase"),
    ([0], "step 0 after 0: steps must increase, from 1"),
    ([10, 10.5], "step 10.5 is not an integer"),
    ([MAX_STEP + 1], f"above {MAX_STEP}"),
])
def test_a_step_that_does_not_increase_is_bad_input_and_keeps_what_was_committed(
        tmp_path, caplog, steps, message):
    assert _steps_in_process(tmp_path, steps, caplog) == Outcome.BAD_INPUT.exit_code
    assert message in caplog.text
    repo = _repo(tmp_path)
    kept = [s for s in steps if isinstance(s, int) and 0 < s <= MAX_STEP and s % 10 == 0]
    assert [repo.verify(n).step for n in repo.committed()] == sorted(set(kept))


STEPS_SCRIPT = """
import sys
import torch
from trainer import CheckpointSession

with CheckpointSession(run="r", experiment="e", store=sys.argv[1], every_steps=10,
                       heartbeat_seconds=60) as ckpt:
    model = torch.nn.Linear(2, 2)
    ckpt.restore(model=model)
    for step in map(int, sys.argv[2].split(",")):
        with torch.no_grad():
            model.weight.fill_(step)  # each checkpoint holds its own step's weights
        ckpt.step(step, loss=1.0)
"""


def _run_steps(tmp_path: Path, steps: str) -> subprocess.CompletedProcess:
    script = tmp_path / "loop.py"
    script.write_text(STEPS_SCRIPT)
    return subprocess.run([sys.executable, str(script), str(tmp_path / "store"), steps],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
def test_a_loop_passing_steps_10_20_10_exits_2_and_both_checkpoints_stay_verifiable(tmp_path):
    res = _run_steps(tmp_path, "10,20,10")
    assert res.returncode == Outcome.BAD_INPUT.exit_code, res.stderr
    assert "bad_input: step 10 after 20: steps must increase" in res.stderr
    assert "storage_unavailable" not in res.stderr and "Traceback" not in res.stderr
    repo = _repo(tmp_path / "store")
    assert repo.read_pointer().step == 20
    for step, name in zip((10, 20), repo.committed(), strict=True):
        m = repo.verify(name)
        assert m.step == step
        assert torch.all(load_verified_state(repo, m)["model"]["weight"] == step)


# -- config values -------------------------------------------------------------------------

OUT_OF_RANGE = [
    ({"threads": 1_000_000_000_000}, "threads"),
    ({"optim": {"lr": 1e308}}, "optim.lr"),
    ({"seed": -1}, "seed"),
    ({"seed": MAX_SEED + 1}, "seed"),
    ({"optim": {"weight_decay": 1e308}}, "optim.weight_decay"),
    ({"optim": {"warmup_steps": MAX_STEP + 1}}, "optim.warmup_steps"),
    ({"max_steps": MAX_STEP + 1}, "max_steps"),
    ({"threads": MAX_PARALLEL + 1}, "threads"),
    ({"data": {"num_workers": 10**12}}, "data.num_workers"),
    ({"task_args": {"scale": float("inf")}}, "task_args.scale"),
]


@pytest.mark.parametrize("raw, key", OUT_OF_RANGE)
def test_a_config_value_out_of_the_range_torch_takes_is_refused_naming_the_key(raw, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        config_from_dict(raw)


def test_torch_refusing_a_value_that_passed_the_ranges_is_still_bad_input_naming_it():
    # What the ranges would miss (a torch that takes less than it did): the config's key,
    # not a traceback. model_construct skips validation, as a range that is too wide would.
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        with pytest.raises(ConfigError, match="config key 'threads' was refused by torch"):
            seed_everything(TrainConfig.model_construct(threads=10**12))
        with pytest.raises(ConfigError, match="config key 'seed' was refused by torch"):
            seed_everything(TrainConfig.model_construct(seed=-1))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    model = torch.nn.Linear(2, 2)
    for optim, key in [({"lr": -1.0}, "optim.lr"), ({"betas": [2.0, 0.5]}, "optim.betas"),
                       ({"weight_decay": -1.0}, "optim.weight_decay")]:
        with pytest.raises(ConfigError, match=f"config key '{key}' was refused by torch"):
            default_optimizer(OptimConfig.model_construct(**optim), model)


def test_the_highest_thread_count_the_config_allows_is_one_torch_takes_and_one_more_is_refused():
    assert config_from_dict({"threads": MAX_PARALLEL}).threads == MAX_PARALLEL
    with pytest.raises(ConfigError, match="config key 'threads'"):
        config_from_dict({"threads": MAX_PARALLEL + 1})
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(MAX_PARALLEL)
        assert torch.get_num_threads() == MAX_PARALLEL
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("raw, key", OUT_OF_RANGE[:3])
def test_the_trainer_exits_2_naming_the_key_for_values_torch_would_refuse(tmp_path, raw, key):
    cfg = write_config(tmp_path / "cfg.json", max_steps=3, **raw)
    res = run_trainer(cfg, str(tmp_path / "store"), timeout=300)
    assert res.returncode == Outcome.BAD_INPUT.exit_code, res.log
    assert f"bad_input: config key '{key}'" in res.log and "Traceback" not in res.log
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("MANIFEST.json"))


@pytest.mark.slow
@pytest.mark.parametrize("warmup_steps", [0, MAX_STEP])
def test_the_edges_of_every_range_train_or_diverge_but_never_fail_as_a_bug(
        tmp_path, warmup_steps):
    """The largest values the ranges allow, together: torch takes them all (a run may
    diverge, exit 4, on such values; it never dies of an overflow, exit 1). Without warm-up
    the largest learning rate applies from the first step."""
    cfg = write_config(tmp_path / "cfg.json", max_steps=4, eval_every=2, seed=MAX_SEED,
                       optim={"lr": MAX_LR, "weight_decay": MAX_WEIGHT_DECAY,
                              "betas": [0.9999999999999999, 0.9999999999999999],
                              "warmup_steps": warmup_steps, "grad_clip": 1e300},
                       checkpoint={"every_steps": 2, "every_seconds": 1e300})
    res = run_trainer(cfg, str(tmp_path / "store"), timeout=300)
    assert res.returncode in (Outcome.SUCCESS.exit_code, Outcome.DIVERGED.exit_code), res.log


def test_a_cuda_index_beyond_the_machines_devices_is_bad_input(monkeypatch):
    from trainer.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="'cuda:3' but this machine has 1 CUDA device"):
        resolve_device("cuda:3")
    assert resolve_device("cuda:0") == torch.device("cuda:0")
