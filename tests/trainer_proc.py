"""Run the trainer CLI as a real subprocess and interrupt it with real signals."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STEP_RE = re.compile(r"step (\d+) done")
COMMIT_RE = re.compile(r"checkpoint committed: step (\d+)")


@dataclass
class Result:
    returncode: int
    log: str
    committed: list[int] = field(default_factory=list)


def config_dict(**overrides) -> dict:
    """The standalone tests' training config, with `overrides` merged in (a dict one level)."""
    cfg = {"run": "equiv", "max_steps": 110, "eval_every": 40, "batch_size": 32,
           "checkpoint": {"every_steps": 20, "keep_last": 2},
           "task_args": {"n_train": 1024, "hidden": 48}}
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    return cfg


def write_config(path: Path, **overrides) -> Path:
    path.write_text(json.dumps(config_dict(**overrides)))
    return path


def uninterrupted_state(workdir: Path, cfg: dict) -> dict:
    """The training state a run of `cfg` ends with, trained by the plain trainer CLI without
    a fault: what every resumed run of the same config must equal bit for bit."""
    (workdir / "cfg.json").write_text(json.dumps(cfg))
    res = run_trainer(workdir / "cfg.json", str(workdir / "store"))
    assert res.returncode == 0, res.log
    return training_state(final_state(workdir / "store", run=cfg["run"]))


def run_trainer(config: Path, store: str, *args: str, interrupt_at: int | None = None,
                sig: int = signal.SIGKILL, env: dict | None = None, timeout: float = 300,
                wrapper: Path | None = None) -> Result:
    """Run `python -m trainer` (through `wrapper`, a script that patches it, if given); if
    `interrupt_at` is set, send `sig` once step k is done."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, *([str(wrapper)] if wrapper else []), "-m", "trainer",
         "--config", str(config), "--store", store,
         "--log-level", "DEBUG", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, cwd=ROOT)
    lines: list[str] = []
    committed: list[int] = []
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    sent = False
    try:
        for line in proc.stdout:
            lines.append(line)
            if m := COMMIT_RE.search(line):
                committed.append(int(m.group(1)))
            m = STEP_RE.search(line)
            if interrupt_at is not None and not sent and m and int(m.group(1)) >= interrupt_at:
                proc.send_signal(sig)
                sent = True
        proc.wait()
    finally:
        timer.cancel()
    return Result(proc.returncode, "".join(lines), committed)


def final_state(store_dir: Path, experiment: str = "default", run: str = "equiv") -> dict:
    ckdir = store_dir / experiment / run / "checkpoints"
    name = json.loads((ckdir / "latest.json").read_text())["checkpoint"]
    return torch.load(ckdir / name / "state.pt", weights_only=True)


def assert_bitwise_equal(a, b, path: str = "state") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path} keys differ: {set(a) ^ set(b)}"
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path} length differs"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def training_state(state: dict) -> dict:
    """What must match an uninterrupted run: everything but wall-clock-only fields."""
    return {k: state[k] for k in ("model", "optimizer", "scheduler", "scaler", "data", "loop", "rng")}
