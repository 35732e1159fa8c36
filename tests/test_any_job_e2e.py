"""The examples through Dagster: killed at seeded random steps, resumed by the real
dagster-daemon's sensors, and ending bitwise identical to an uninterrupted standalone run.

A digits classifier in its own loop and a plain script both run as `command:` runs; the
character-level language model runs in task mode. The signal's target is the training
process itself, found by the pid in its heartbeat (one per step in these configs).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.daemon_harness import ROOT, Daemon, kill
from tests.trainer_proc import assert_bitwise_equal, final_state

pytestmark = pytest.mark.slow

CHAR_LM = ROOT / "examples" / "char_lm"
SLOW = ["python", "tests/slow_steps.py"]  # STEP_DELAY seconds per step: room to signal
RNG = random.Random(20261129)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    work = tmp_path_factory.mktemp("any-job-e2e")
    pythonpath = os.pathsep.join([str(ROOT), str(CHAR_LM)])
    d = Daemon.start(work, str(work / "store"), extra_env={"PYTHONPATH": pythonpath})
    yield d
    d.stop()


def _standalone(argv: list[str], store: Path, extra_env: dict | None = None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "DAGSTER_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(CHAR_LM)])
    res = subprocess.run([sys.executable, *argv], cwd=ROOT, env={**env, **(extra_env or {})},
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr


def _interrupt_and_finish(daemon: Daemon, run: str, config: dict, tmp_path: Path,
                          chain: list[tuple[int, int]]) -> dict:
    """Launch `run`, send each (step, signal) of `chain` to its training process, one
    attempt after another, and return the final state once the sensor-resumed run ended."""
    daemon.launch(run, config, tmp_path)
    for attempt, (step, sig) in enumerate(chain, start=1):
        hb = daemon.wait_for_step(run, step, attempt=attempt)
        kill(hb["pid"], sig)
    final = daemon.wait_done(run, timeout=600)
    runs = daemon.runs(run)
    assert len(runs) == len(chain) + 1, [(r.run_id[:8], r.status.value) for r in runs]
    assert [r.tags.get("ckpt/decision") for r in runs[:-1]] == ["resume"] * len(chain)
    assert final.tags["ckpt/attempt"] == str(len(chain) + 1)
    assert daemon.max_active[run] == 1
    return final_state(Path(daemon.store), "default", run)


def _command_config(argv: list[str], steps: int) -> dict:
    return {"command": [*SLOW, *argv], "max_steps": steps, "env": {"STEP_DELAY": "0.05"},
            "checkpoint": {"heartbeat_seconds": 0}}


def test_the_plain_script_killed_through_dagster_is_resumed_by_the_sensor_bitwise(
        daemon, tmp_path):
    argv = ["examples/plain_script/train.py", "--steps", "150"]
    _standalone(argv + ["--store", str(tmp_path / "base")], tmp_path / "base")
    want = final_state(tmp_path / "base", "plain", "plain")
    got = _interrupt_and_finish(daemon, "plain-cmd", _command_config(argv, 150), tmp_path,
                                [(RNG.randint(15, 60), signal.SIGKILL)])
    assert_bitwise_equal(want, got)


def test_the_digits_classifier_in_its_own_loop_survives_sigkill_and_sigterm_bitwise(
        daemon, tmp_path):
    argv = ["examples/digits/train.py", "--steps", "120"]
    _standalone(argv + ["--store", str(tmp_path / "base")], tmp_path / "base")
    want = final_state(tmp_path / "base", "digits", "digits")
    first = RNG.randint(10, 45)
    chain = [(first, signal.SIGKILL), (RNG.randint(first + 15, 100), signal.SIGTERM)]
    got = _interrupt_and_finish(daemon, "digits-cmd", _command_config(argv, 120), tmp_path,
                                chain)
    assert_bitwise_equal(want, got)


def test_the_char_lm_task_survives_sigkill_and_sigterm_through_dagster_bitwise(
        daemon, tmp_path):
    cfg = yaml.safe_load((CHAR_LM / "config.yaml").read_text())
    cfg.pop("experiment")
    cfg["run"] = "char-lm-task"
    cfg["max_steps"] = 400
    cfg["checkpoint"]["heartbeat_seconds"] = 0
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(cfg))
    _standalone(["-m", "trainer", "--config", str(base), "--store", str(tmp_path / "base")],
                tmp_path / "base")
    want = final_state(tmp_path / "base", "default", "char-lm-task")
    first = RNG.randint(20, 120)
    chain = [(first, signal.SIGKILL), (RNG.randint(first + 40, 300), signal.SIGTERM)]
    got = _interrupt_and_finish(daemon, "char-lm-task", cfg, tmp_path, chain)
    assert_bitwise_equal(want, got)
