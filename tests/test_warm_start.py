"""A warm trainer (`ckpt_assets.warm_start`, `trainer.standby`): a standby interpreter with
torch imported becomes the next attempt exactly as a fresh `python` would have started it,
and only when nothing the interpreter or torch read at start-up has changed since.

The fast tests check the rules; the slow ones hand real standby processes real attempts.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from ckpt_assets.settings import ResumeSettings
from ckpt_assets.warm_start import WarmTrainer
from tests.polling import pid_alive
from trainer.contract import Env
from trainer.standby import Handoff, entry, standing_env

PY = sys.executable
LOG = logging.getLogger("test_warm_start")
BASE_ENV = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(Path(__file__).parents[1]),
            "PYTHONUNBUFFERED": "1"}
PER_ATTEMPT = {Env.ATTEMPT.value: "2", Env.RUN.value: "r", "DAGSTER_PIPES_CONTEXT": "ctx"}

# What the attempt's code sees of how it was started, as JSON on its output; then exit 3.
REPORT = textwrap.dedent("""
    import json, os, sys
    print(json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(),
                      "path0": sys.path[0], "attempt": os.environ.get("CKPT_ATTEMPT"),
                      "pipes": os.environ.get("DAGSTER_PIPES_CONTEXT"),
                      "late": os.environ.get("LATE"),
                      "torch_loaded": "torch" in sys.modules}))
    sys.exit(3)
""")


def test_a_standby_runs_python_modules_and_scripts_and_nothing_else():
    assert entry([PY, "-m", "trainer", "--config", "c.json"]) == ("module", "trainer")
    assert entry([PY, "train.py", "--lr", "1"]) == ("script", "train.py")
    assert entry([PY, "-u", "train.py"]) is None  # an interpreter option it did not start with
    assert entry([PY, "-c", "print(1)"]) is None
    assert entry(["bash", "run.sh"]) is None
    assert entry([PY, "-m", "trainer.ranks", "--nproc-per-node", "2", "--", PY]) is None


def test_a_handoff_fits_only_the_same_interpreter_and_environment_but_the_per_attempt_names():
    argv = [PY, "-m", "trainer", "--config", "c.json"]
    standing = standing_env({**BASE_ENV, Env.ATTEMPT.value: "1"})
    assert standing == BASE_ENV
    fits = Handoff(argv, {**BASE_ENV, **PER_ATTEMPT}, "/", "/tmp/out")
    assert fits.unfit(PY, standing) is None
    assert Handoff.from_line(fits.to_line()) == fits
    assert "interpreter" in fits.unfit("/usr/bin/python3.9", standing)
    # Read at the interpreter's or torch's start: a standby started without it cannot be it.
    changed = Handoff(argv, {**BASE_ENV, **PER_ATTEMPT, "OMP_NUM_THREADS": "1"}, "/", "o")
    assert "(OMP_NUM_THREADS)" in changed.unfit(PY, standing)
    # Read later, by the attempt's own code: it takes the attempt's value at the handoff.
    later = Handoff(argv, {**BASE_ENV, **PER_ATTEMPT, "_MLFLOW_TELEMETRY_SESSION_ID": "x"}, "/",
                    "o")
    assert later.unfit(PY, standing) is None
    assert "is not `python -m" in Handoff([PY, "-c", "pass"], BASE_ENV, "/", "o").unfit(
        PY, standing)


def test_the_warm_trainer_is_off_with_the_in_run_relaunch_or_its_own_setting():
    assert WarmTrainer(ResumeSettings(), LOG).enabled
    assert not WarmTrainer(ResumeSettings(warm_trainer=False), LOG).enabled
    assert not WarmTrainer(ResumeSettings(in_run_relaunch=False), LOG).enabled


def _report(output: Path) -> dict:
    return json.loads(output.read_text().strip().splitlines()[-1])


@pytest.mark.slow
def test_a_standby_becomes_a_script_as_python_would_have_started_it(tmp_path):
    script = tmp_path / "code" / "report.py"
    script.parent.mkdir()
    script.write_text(REPORT)
    argv = [PY, str(script), "--lr", "0.1"]
    warm = WarmTrainer(ResumeSettings(), LOG)
    warm.refill(argv, {**BASE_ENV, Env.ATTEMPT.value: "1", "LATE": "old"}, str(tmp_path))
    output = tmp_path / "attempt-2.log"
    try:
        proc = warm.take(argv, {**BASE_ENV, **PER_ATTEMPT, "LATE": "new"}, str(tmp_path),
                         str(output))
        assert proc is not None
        assert proc.wait(60) == 3  # its exit status is the attempt's
    finally:
        warm.close()
    seen = _report(output)
    assert seen == {"name": "__main__", "argv": [str(script), "--lr", "0.1"],
                    "cwd": str(tmp_path), "path0": str(script.parent), "attempt": "2",
                    "pipes": "ctx", "late": "new", "torch_loaded": True}


@pytest.mark.slow
def test_a_standby_becomes_a_module_run_with_dash_m_in_the_attempts_directory(tmp_path):
    (tmp_path / "report_mod.py").write_text(REPORT)
    argv = [PY, "-m", "report_mod", "x"]
    warm = WarmTrainer(ResumeSettings(), LOG)
    warm.refill(argv, BASE_ENV, "/")
    output = tmp_path / "attempt.log"
    try:
        proc = warm.take(argv, {**BASE_ENV, **PER_ATTEMPT}, str(tmp_path), str(output))
        assert proc is not None and proc.wait(60) == 3
    finally:
        warm.close()
    seen = _report(output)
    assert seen["name"] == "__main__" and seen["argv"][1:] == ["x"]
    assert seen["cwd"] == seen["path0"] == str(tmp_path)


@pytest.mark.slow
def test_a_changed_environment_is_not_handed_to_the_standby_which_is_stopped(tmp_path):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    argv = [PY, str(script)]
    warm = WarmTrainer(ResumeSettings(), LOG)
    warm.refill(argv, BASE_ENV, str(tmp_path))
    standby = warm._standby.proc
    output = tmp_path / "cold.log"
    try:
        env = {**BASE_ENV, **PER_ATTEMPT, "OMP_NUM_THREADS": "1"}
        assert warm.take(argv, env, str(tmp_path), str(output)) is None
        assert standby.poll() is not None  # stopped, not left idle
    finally:
        warm.close()


@pytest.mark.slow
def test_an_unused_standby_is_stopped_with_the_step_and_a_stop_before_handoff_ends_it(
        tmp_path):
    warm = WarmTrainer(ResumeSettings(), LOG)
    warm.refill([PY, "-m", "trainer"], BASE_ENV, str(tmp_path))
    pid = warm._standby.proc.pid
    warm.close()
    assert not pid_alive(pid)
    # Before its handoff a standby is any fresh process: SIGTERM ends it at once.
    warm.refill([PY, "-m", "trainer"], BASE_ENV, str(tmp_path))
    proc = warm._standby.proc
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGTERM
    # A dead standby is never handed an attempt: it starts cold.
    assert warm.take([PY, "-m", "trainer"], BASE_ENV, str(tmp_path),
                     str(tmp_path / "out.log")) is None
