"""A project with a `trainer.py` of its own (minGPT's shape) uses the checkpointing API
through the README's import line (`ckpt_trainer`), standalone and under the ranks launcher
started from its directory; its own `trainer` module stays its own, and no module of ours
is loaded twice in one process, whichever of the two names asks for it."""

from __future__ import annotations

import os
import re
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

# The one import line of the README's port (its diff's `+from ... import CheckpointSession`).
README_IMPORT = re.search(r"^\+(from \S+ import CheckpointSession)$",
                          (ROOT / "README.md").read_text(), re.M).group(1)
# Every module object of this project loaded in the process, by file: one file loaded as
# two module objects is a module loaded twice.
TWICE = '''
ours = [m.__file__ for m in {{id(m): m for m in list(sys.modules.values())}}.values()
        if (getattr(m, "__file__", None) or "").startswith({!r})]
print("loaded twice:", sorted({{f for f in ours if ours.count(f) > 1}}), len(ours), flush=True)
'''.format(str(ROOT / "trainer"))

MAIN = '''\
import os
import sys

import torch
import torch.distributed as dist

''' + README_IMPORT + '''
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
''' + TWICE


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
    assert "loaded twice: [] " in res.stdout
    assert "checkpoint committed: step 4" in res.stderr


def test_the_ranks_launcher_started_from_that_directory_runs_every_rank(project):
    res = run(project, "-m", "ckpt_trainer.ranks", "--nproc-per-node", "2", "--",
              sys.executable, "main.py", str(project / "store"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count(f"trainer modules: ['trainer'] {project / 'trainer.py'}") == 2
    assert (project / "store" / "e" / "own" / "checkpoints" / "step-000000004-a1").is_dir()
    assert res.stdout.count("loaded twice: [] ") == 2


def test_the_readme_imports_the_api_by_a_name_no_project_shadows():
    assert README_IMPORT == "from ckpt_trainer import CheckpointSession"


def test_where_trainer_is_ours_both_names_are_one_set_of_modules(tmp_path):
    code = ("import sys\n"
            "from trainer.api.session import CheckpointSession as A\n"
            "from trainer.base.errors import ConfigError as E\n"
            "import ckpt_trainer.ranks.launch\n"
            "from ckpt_trainer import CheckpointSession as B, ConfigError as F\n"
            "print('same:', A is B, E is F, ckpt_trainer.ranks.launch.__spec__.name)\n" + TWICE)
    res = run(tmp_path, "-c", code)
    assert res.returncode == 0, res.stderr
    assert "same: True True trainer.ranks.launch" in res.stdout
    assert "loaded twice: [] " in res.stdout
