"""`ckpt.epochs()` and a `ResumableLoader` part combined as the docs show, in a real process:
each epoch trains the loader's next epoch, never the same one again, and a run stopped
inside an epoch resumes at the very next batch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer_proc import ROOT
from trainer import ResumableLoader
from trainer.base.outcomes import Outcome

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[1] / "loader_walk_script.py"
LINE = re.compile(r"step (\d+) epoch \d+ samples (\[.*\])")


def run(store: Path, form: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CKPT_RUN", None)
    return subprocess.run([sys.executable, str(SCRIPT), "--store", str(store), "--form", form,
                           *args], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def trained(res: subprocess.CompletedProcess) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in LINE.finditer(res.stdout)}


def loader_epochs(epochs: int = 3) -> dict[int, str]:
    """What the script's loader hands out over `epochs` epochs, iterated plainly."""
    loader = ResumableLoader(torch.arange(64, dtype=torch.float32).unsqueeze(1), 8, seed=1)
    batches = [b for _ in range(epochs) for b in loader]
    return {i + 1: str(b.flatten().int().tolist()) for i, b in enumerate(batches)}


@pytest.mark.parametrize("form", ["zip", "batches"])
def test_each_epoch_of_epochs_trains_the_loaders_next_epoch_and_a_stop_inside_one_resumes_at_the_next_batch(
        tmp_path, form):
    first = run(tmp_path, form, "--sigterm-at", "12")
    assert first.returncode == Outcome.PREEMPTED.exit_code, first.stderr
    second = run(tmp_path, form)
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr and min(trained(second)) == 14
    assert {**trained(first), **trained(second)} == loader_epochs()


def test_batches_of_a_loader_that_is_not_a_restored_part_is_refused_as_bad_input(tmp_path):
    script = tmp_path / "stray.py"
    script.write_text(SCRIPT.read_text().replace("data=loader)", ")"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(script), "--store", str(tmp_path / "s"),
                          "--form", "batches"], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    assert res.returncode == Outcome.BAD_INPUT.exit_code, res.stderr
    assert "pass the ResumableLoader to restore() as a part" in res.stderr
