"""The edges of a user's workflow, with a real script in a real process each time: a
script that trains nothing does not exit 0 silently; a finished run, run again, trains
nothing unless continuing it is asked for; a resume whose unseeded generators began
elsewhere than the first attempt's is named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer_proc import ROOT
from trainer.base.outcomes import Outcome
from trainer.base.rng_identity import ADVICE
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import open_store

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[1] / "edge_script.py"


def run(store: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("CKPT_RUN", None)
    return subprocess.run([sys.executable, str(SCRIPT), "--store", str(store), *args],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


def checkpoints(store: Path) -> list[str]:
    d = store / "e" / "edge" / "checkpoints"
    return sorted(p.name for p in d.iterdir() if p.name.startswith("step-")) if d.exists() else []


def test_a_script_that_trains_no_step_exits_8_no_checkpoint_and_says_so(tmp_path):
    res = run(tmp_path, "--no-steps")
    assert res.returncode == Outcome.NO_CHECKPOINT.exit_code == 8, res.stderr
    assert "ended without training a step" in res.stderr
    assert "training finished" not in res.stderr and "Traceback" not in res.stderr
    assert checkpoints(tmp_path) == []


def test_a_finished_run_run_again_trains_nothing_and_exits_0_saying_already_finished(tmp_path):
    first = run(tmp_path, "--seed", "0", "--until", "23")
    assert first.returncode == 0, first.stderr
    assert "left the loop at step 23" in first.stdout
    before = checkpoints(tmp_path)
    again = run(tmp_path, "--seed", "0", "--until", "23")
    assert again.returncode == 0, again.stderr
    assert "already finished at step 23" in again.stderr
    assert "left the loop" not in again.stdout  # the open-ended loop never ran
    assert checkpoints(tmp_path) == before


def test_continuing_a_finished_run_is_an_explicit_act_that_trains_past_its_end(tmp_path):
    assert run(tmp_path, "--seed", "0", "--until", "23").returncode == 0
    more = run(tmp_path, "--seed", "0", "--until", "23", "--continue-finished")
    assert more.returncode == 0, more.stderr
    assert "resumed from" in more.stderr and "left the loop at step 46" in more.stdout


def test_a_step_past_max_steps_exits_2_and_names_step_called_twice_per_batch(tmp_path):
    res = run(tmp_path, "--max-steps", "20", "--until", "20", "--calls-per-batch", "2")
    assert res.returncode == Outcome.BAD_INPUT.exit_code == 2, res.stderr
    assert "step 21 is past max_steps=20" in res.stderr
    assert "more than once per optimizer step (twice per batch" in res.stderr
    assert "left the loop" not in res.stdout and "Traceback" not in res.stderr
    assert final_kept(tmp_path)["final"] is False  # unfinished: the script never ended


def test_a_part_that_cannot_be_pickled_exits_2_naming_part_and_key_and_leaves_no_folder(tmp_path):
    res = run(tmp_path, "--unsavable")
    assert res.returncode == Outcome.BAD_INPUT.exit_code, res.stderr
    assert "part 'stats', key 'log' holds a TextIOWrapper" in res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.splitlines()) < 5, res.stderr
    assert checkpoints(tmp_path) == []


def final_kept(store: Path) -> dict:
    """The kept values of the checkpoint the run's pointer names, and whether it is final."""
    repo = CheckpointRepo(open_store(str(store)), "e", "edge")
    manifest = repo.read_manifest(repo.read_pointer().checkpoint)
    state = torch.load(repo.layout.store.local_path(repo.key(manifest.name, "state.pt")),
                       weights_only=True)
    return {**state["kept"], "final": manifest.meta["final"], "step": manifest.step}


def test_a_run_killed_after_its_last_step_before_the_scripts_end_is_not_finished_and_resumes(
        tmp_path):
    killed = run(tmp_path, "--seed", "0", "--max-steps", "20", "--until", "20",
                 "--kill-after-loop")
    assert killed.returncode == -9 and "left the loop at step 20" in killed.stdout
    again = run(tmp_path, "--seed", "0", "--max-steps", "20", "--until", "20")
    assert again.returncode == 0, again.stderr
    assert "already finished" not in again.stderr and "resumed from" in again.stderr
    assert "post-loop work done" in again.stdout
    assert final_kept(tmp_path) == {"phase": "evaluated", "final": True, "step": 20}


def test_a_run_whose_last_step_was_a_trigger_is_finished_with_the_values_its_script_ended_with(
        tmp_path):
    first = run(tmp_path, "--seed", "0", "--until", "20")  # every_steps=5: 20 is a trigger
    assert first.returncode == 0 and "post-loop work done" in first.stdout, first.stderr
    assert final_kept(tmp_path) == {"phase": "evaluated", "final": True, "step": 20}
    again = run(tmp_path, "--seed", "0", "--until", "20")
    assert again.returncode == 0 and "already finished at step 20" in again.stderr
    assert "post-loop work done" not in again.stdout


def _interrupted_then_resumed(store: Path, *args: str) -> subprocess.CompletedProcess:
    first = run(store, "--sigterm-at", "7", *args)
    assert first.returncode == Outcome.PREEMPTED.exit_code, first.stderr
    second = run(store, "--until", "20", *args)
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr
    return second


def test_a_resume_of_a_script_that_seeds_nothing_names_the_attempt_and_says_how_to_seed(tmp_path):
    second = _interrupted_then_resumed(tmp_path)
    assert "attempt 2 began with other random generator states (torch" in second.stderr
    assert "than attempt 1" in second.stderr and ADVICE in second.stderr


def test_a_resume_of_a_script_that_never_draws_from_numpy_or_python_random_says_nothing_of_them(
        tmp_path):
    second = _interrupted_then_resumed(tmp_path, "--seed-torch")
    assert "generator" not in second.stderr, second.stderr


def test_a_resume_of_a_script_that_drew_from_unseeded_numpy_before_restore_warns_naming_it(
        tmp_path):
    second = _interrupted_then_resumed(tmp_path, "--seed-torch", "--numpy-split")
    assert "attempt 2 began with other random generator states (numpy) than attempt 1" \
        in second.stderr, second.stderr
    assert ADVICE in second.stderr


def test_a_resume_of_a_script_seeded_through_the_session_warns_of_nothing(tmp_path):
    second = _interrupted_then_resumed(tmp_path, "--seed", "3")
    assert "generator" not in second.stderr, second.stderr


DEFAULT_STORE_SCRIPT = """\
import os, signal, torch
from trainer import CheckpointSession

model = torch.nn.Linear(2, 1)
with CheckpointSession(run="moved", max_steps=20, every_steps=5) as ckpt:
    for step in range(ckpt.restore(model=model) + 1, 21):
        if ckpt.step(step, loss=float(step)):
            break
        if step == 7:
            os.kill(os.getpid(), signal.SIGTERM)  # the next step() commits and exits 143
"""


def test_a_script_run_from_another_directory_names_the_store_it_starts_in_and_the_run_beside_it(
        tmp_path):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "train.py").write_text(DEFAULT_STORE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("CKPT_RUN", "CKPT_STORE_URI", "CKPT_RESUME_FROM"):
        env.pop(key, None)

    def run_from(cwd: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(project / "train.py")], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=300)

    first = run_from(project)
    assert first.returncode == Outcome.PREEMPTED.exit_code, first.stderr
    moved = run_from(elsewhere)
    assert moved.returncode == Outcome.PREEMPTED.exit_code, moved.stderr
    (line,) = [ln for ln in moved.stderr.splitlines() if "from scratch" in ln]
    assert f"in store {elsewhere / 'checkpoints'}" in line, line
    assert f"{project / 'checkpoints'} holds this run at step 8" in line, line
    assert f"CKPT_STORE_URI={project / 'checkpoints'}" in line, line
