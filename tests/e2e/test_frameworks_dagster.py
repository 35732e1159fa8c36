"""A Hugging Face Trainer script as a `command:` run under a real dagster-daemon: killed
once, resumed once by the sensors, ending as the uninterrupted run ends.

The script is `examples/hf_trainer/train.py` as its users run it (`train(trainer)`, no flag
of ours): the orchestrator hands its session the run, the store and the attempt through the
environment. What differs between the frameworks (SIGTERM, the Lightning Trainer,
torchdata) is proven standalone by tests/frameworks/.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_harness import ROOT, kill
from tests.trainer_proc import assert_bitwise_equal

pytest.importorskip("transformers", reason="an optional extra: pip install -e '.[hf]'")
from tests.frameworks.test_hf_trainer import trainer_files  # noqa: E402 (needs transformers)

pytestmark = pytest.mark.slow

STEPS = 60
SCRIPT = ["examples/hf_trainer/train.py", "--steps", str(STEPS)]


@pytest.fixture
def daemon(sensors_daemon):
    # The shared daemon has the in-run relaunch off: the killed attempt's run fails, and
    # the sensors resume it as a new run (tests/e2e/conftest.py).
    return sensors_daemon.get()


def test_a_sigkilled_hf_trainer_command_run_is_resumed_once_by_the_sensors_and_ends_bitwise_as_the_uninterrupted_run(
        daemon, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "DAGSTER_"))}
    env.update(PYTHONPATH=str(ROOT), CKPT_STORE_URI=str(tmp_path / "base"))
    res = subprocess.run([sys.executable, *SCRIPT, "--output-dir", str(tmp_path / "base-out")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    want = trainer_files(tmp_path / "base", "hf", "tiny-gpt2")

    # A heartbeat every step or two: the kill lands at the step drawn, not seconds later.
    config = {"command": ["python", "tests/slow_hf_steps.py", *SCRIPT,
                          "--output-dir", str(tmp_path / "out")],
              "max_steps": STEPS, "env": {"STEP_DELAY": "0.1"},
              "checkpoint": {"heartbeat_seconds": 0.05}}
    daemon.launch("hf-cmd", config, tmp_path)
    # After the Trainer's first save (every 15 steps), so the resume is handed a checkpoint.
    hb = daemon.wait_for_step("hf-cmd", random.Random("hf-cmd").randint(20, 50), attempt=1)
    kill(hb["pid"], signal.SIGKILL)
    final = daemon.wait_done("hf-cmd", timeout=600)
    first, resumed = daemon.runs("hf-cmd")
    assert (first.tags["ckpt/decision"], first.tags["ckpt/failure_kind"]) == ("resume", "killed")
    assert resumed.run_id == final.run_id and final.tags["ckpt/attempt"] == "2"
    assert final.tags["ckpt/resume_from"].startswith(Path(daemon.store).as_uri())
    assert daemon.max_active["hf-cmd"] == 1
    assert_bitwise_equal(want, trainer_files(Path(daemon.store), "default", "hf-cmd"))
