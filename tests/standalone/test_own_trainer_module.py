"""A project with a `trainer.py` of its own (minGPT's shape) uses the checkpointing API
as `ckpt_trainer`, standalone and under the ranks launcher started from its directory,
and its own `trainer` module stays its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer_proc import ROOT

pytestmark = pytest.mark.slow

OWN_TRAINER = '''\
class Trainer:  # the project's own, as in minGPT-ddp
    steps = 4
'''

MAIN = '''\
import os
import sys

import torch
import torch.distributed as dist

from ckpt_trainer import CheckpointSession
from trainer import Trainer

if int(os.environ.get("WORLD_SIZE", 1)) > 1:
    dist.init_process_group("gloo")
model = torch.nn.Linear(2, 1)
ckpt = CheckpointSession(run="own", experiment="e", store=sys.argv[1], seed=0,
                         max_steps=Trainer.steps)
start = ckpt.restore(model=model)
for step in range(start + 1, Trainer.steps + 1):
    ckpt.step(step, loss=1.0 / step)
ours = sorted(m for m in sys.modules if m == "trainer" or m.startswith("trainer."))
print("trainer modules:", ours, sys.modules["trainer"].__file__, flush=True)
'''


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "trainer.py").write_text(OWN_TRAINER)
    (tmp_path / "main.py").write_text(MAIN)
    return tmp_path


def run(project: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *argv], cwd=project, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_script_beside_its_own_trainer_py_checkpoints_through_ckpt_trainer(project):
    res = run(project, "main.py", str(project / "store"))
    assert res.returncode == 0, res.stderr
    assert f"trainer modules: ['trainer'] {project / 'trainer.py'}" in res.stdout
    assert "checkpoint committed: step 4" in res.stderr


def test_the_ranks_launcher_started_from_that_directory_runs_every_rank(project):
    res = run(project, "-m", "ckpt_trainer.ranks", "--nproc-per-node", "2", "--",
              sys.executable, "main.py", str(project / "store"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count(f"trainer modules: ['trainer'] {project / 'trainer.py'}") == 2
    assert (project / "store" / "e" / "own" / "checkpoints" / "step-000000004-a1").is_dir()
