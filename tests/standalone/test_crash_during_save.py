"""SIGKILL inside the save window never leaves a run without a verified checkpoint.

Twelve seeded kills here, each at a random point of a save; a kill held inside a known
write is tests/standalone/test_background_save_crash.py's, and the soak runs a thousand by default
(`python benchmarks/soak_crash_during_save.py`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.trainer_proc import ROOT

pytestmark = pytest.mark.slow


def test_twelve_sigkills_inside_saves_each_resume_from_a_verified_checkpoint_losing_no_commit():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak_crash_during_save.py"),
         "--trials", "12", "--seed", "7", "--json"],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    result = json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else {}
    assert result.get("trials") == 12, out.stderr
    assert result["failures"] == 0, result["details"]
    assert out.returncode == 0, out.stderr  # the soak exits 1 exactly when a trial failed
    assert result["final_step"] and result["final_step"] > 0
