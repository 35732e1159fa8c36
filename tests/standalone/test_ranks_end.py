"""The end of a two-rank session whose script destroys its process group after its loop, in
real processes under the ranks launcher: refused with one line saying what to do (never a
storage failure, never one rank writing as another), or committed when the script closes
the session first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer_proc import ROOT
from trainer.base.outcomes import Outcome

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[1] / "ranks_end_script.py"


def run(store: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("CKPT_RUN", None)
    return subprocess.run(
        [sys.executable, "-m", "trainer.ranks", "--nproc-per-node", "2", "--", sys.executable,
         str(SCRIPT), "--store", str(store), *args],
        capture_output=True, text=True, env=env, timeout=300, cwd=store.parent)


def pointer(store: Path) -> dict:
    return json.loads((store / "e" / "ends" / "checkpoints" / "latest.json").read_text())


def test_a_session_ending_after_the_process_group_was_destroyed_exits_2_saying_to_close_first(
        tmp_path):
    store = tmp_path / "store"
    res = run(store)
    out = res.stdout + res.stderr
    assert res.returncode == Outcome.BAD_INPUT.exit_code, out
    assert "call ckpt.close() (or leave the `with` block) before dist.destroy_process_group()" \
        in out
    assert "storage_unavailable" not in out and "already exists" not in out, out
    assert "not registered" not in out and "Traceback" not in out, out
    assert pointer(store)["step"] == 10  # the last trigger: nothing half-written after it


def test_a_session_closed_before_the_process_group_is_destroyed_commits_its_end(tmp_path):
    store = tmp_path / "store"
    res = run(store, "--close-first")
    assert res.returncode == 0, res.stdout + res.stderr
    assert pointer(store)["step"] == 12
    again = run(store)
    assert again.returncode == 0 and "already finished at step 12" in again.stderr, again.stderr
