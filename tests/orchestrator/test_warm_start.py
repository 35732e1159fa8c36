"""A warm trainer (`ckpt_assets.attempt.warm_start`, `trainer.process.standby`): a standby interpreter with
torch imported becomes the next attempt exactly as a fresh `python` would have started it,
and only when nothing the interpreter or torch read at start-up has changed since.

The fast tests check the rules; the slow ones hand real standby processes real attempts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ckpt_assets.attempt.command import (
    AttemptIds,
    base_env,
    command_launch,
    contract,
    standing_launch,
    task_launch,
)
from ckpt_assets.attempt.process import PROCESS_STARTED, WARM_STARTED
from ckpt_assets.attempt.warm_start import IMPORT_S, WarmTrainer, _Standby
from ckpt_assets.base.datasets import DatasetRecord
from ckpt_assets.base.events import ATTEMPT_ENDED, partition_events
from ckpt_assets.base.registration import Registration
from ckpt_assets.definitions import make_resources
from ckpt_assets.defs.resources import TrainerResource
from ckpt_assets.lifecycle.settings import ResumeSettings, Setting
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import materialize_run, training_config
from tests.polling import pid_alive
from trainer.base.process_id import process_state
from trainer.checkpoints.repo import CheckpointRepo
from trainer.config import config_from_dict
from trainer.process.contract import Env
from trainer.process.standby import MODULE, Handoff, entry, own_trainer, standing_env
from trainer.storage import open_store

pytestmark = pytest.mark.warm_standby  # its subject: on even where CKPT_WARM_TRAINER=0 is set

PY = sys.executable
LOG = logging.getLogger("test_warm_start")
BASE_ENV = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(Path(__file__).parents[2]),
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


def test_interpreters_are_compared_resolved_so_a_symlinked_venv_is_the_same_one(tmp_path):
    standing = standing_env(BASE_ENV)
    (tmp_path / ".venv").symlink_to(Path(PY).parent.parent)  # a .venv that links to this one
    linked = Handoff([str(tmp_path / ".venv" / "bin" / Path(PY).name), "-m", "trainer"],
                     BASE_ENV, "/", "o")
    assert linked.unfit(PY, standing) is None
    # The same binary linked from a directory of its own is another environment: Python finds
    # a venv from the directory it was started from, and every venv's python links to its base.
    (tmp_path / "other" / "bin").mkdir(parents=True)
    (tmp_path / "other" / "bin" / "python").symlink_to(PY)
    other = Handoff([str(tmp_path / "other" / "bin" / "python"), "-m", "trainer"], BASE_ENV,
                    "/", "o")
    assert "interpreter" in other.unfit(PY, standing)


def _registration(raw: dict) -> Registration:
    config = config_from_dict({"run": "r", "experiment": "exp", **raw})
    return Registration("r", "exp", config, "file:///store/exp/r/config.json", "0" * 64)


def test_a_standby_started_from_the_runs_standing_launch_fits_each_attempts_launch(tmp_path):
    trainer = TrainerResource(extra_env={"OMP_NUM_THREADS": "2"})
    env = base_env(trainer, {})
    ids = AttemptIds(1, "dagster-run", "dagster-run", None)
    data = DatasetRecord(kind="uri", uri="file:///data", version="v1")
    repo = CheckpointRepo(open_store(str(tmp_path / "store")), "exp", "r")
    task = _registration({"task": "trainer.tasks.toy:build"})
    command = _registration({"command": ["python", "train.py", "--lr", "1"], "cwd": "examples",
                             "env": {"OMP_NUM_THREADS": "1"}})
    launches = [
        (task, task_launch(task, contract(task, repo.store.uri, ids, data), env, trainer,
                           tmp_path)),
        (command, command_launch(command, repo, contract(command, repo.store.uri, ids, data),
                                 env, trainer, LOG))]
    for reg, attempt in launches:
        standing = standing_launch(reg, env, trainer)
        handoff = Handoff(attempt.argv, {**attempt.env, **PER_ATTEMPT}, attempt.cwd, "out")
        assert handoff.unfit(standing.argv[0], standing_env(standing.env)) is None
        assert (standing.cwd, standing.argv) == (attempt.cwd, attempt.argv[:len(standing.argv)])
    # The command's own OMP_NUM_THREADS, which torch reads at import, is the standby's too.
    assert standing.env["OMP_NUM_THREADS"] == "1"
    # Several ranks: torchrun starts them cold, so no standby is started for them.
    ranks = _registration({"task": "trainer.tasks.toy:build",
                           "distributed": {"nproc_per_node": 2}})
    assert entry(standing_launch(ranks, env, trainer).argv) is None


def test_the_first_attempts_standby_is_off_by_its_setting_and_a_relaunchs_also_without_relaunches():
    on = WarmTrainer(ResumeSettings(), LOG)
    assert on.enabled and on.refills
    off = WarmTrainer(ResumeSettings(warm_trainer=False), LOG)
    assert not off.enabled and not off.refills
    no_relaunch = WarmTrainer(ResumeSettings(in_run_relaunch=False), LOG)
    assert no_relaunch.enabled and not no_relaunch.refills


def test_an_attempt_beside_a_trainer_of_its_projects_own_is_never_given_a_standby(
        tmp_path, caplog):
    """A standby has imported this package as `trainer`; the project's script would then get
    it for its own `import trainer`. A project's `trainer.py` or `trainer/`, where `python`
    looks first (the script's directory; the working directory for `-m`), means no standby."""
    project = tmp_path / "project"
    (project / "nested" / "trainer").mkdir(parents=True)
    (project / "trainer.py").write_text("class Trainer:\n    pass\n")
    assert own_trainer([PY, "train.py", "--lr", "1"], str(project)) == str(project / "trainer.py")
    assert own_trainer([PY, "-m", "their_task"], str(project)) == str(project / "trainer.py")
    assert own_trainer([PY, "nested/train.py"], str(project)) == str(project / "nested" / "trainer")
    # A directory without one, and this repository's own trainer/ for `python -m trainer`.
    assert own_trainer([PY, "train.py"], str(tmp_path)) is None
    assert own_trainer([PY, "-m", "trainer"], str(Path(__file__).parents[2])) is None
    warm = WarmTrainer(ResumeSettings(), LOG)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        warm.warm_up([PY, "train.py"], BASE_ENV, str(project))
        for _ in range(3):  # the run asks again on every look at its attempt
            warm.refill([PY, "train.py"], BASE_ENV, str(project))
    assert warm._standby is None  # nothing started
    # Said once, not once a look: each line is an event in the run's log.
    assert caplog.text.count("no standby trainer: the attempt imports") == 1


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


def _answered_standby(warm: WarmTrainer, argv: list[str], cwd: str) -> subprocess.Popen:
    """The standby `warm` starts for `argv`, once it has imported and answered."""
    warm.refill(argv, BASE_ENV, cwd)
    warm.ready(argv, {**BASE_ENV, **PER_ATTEMPT}, cwd)
    assert warm._standby is not None
    return warm._standby.proc


@pytest.mark.slow
@pytest.mark.parametrize("sig, when", [(signal.SIGSTOP, "importing"), (signal.SIGSTOP, "idle"),
                                       (signal.SIGKILL, "idle")])
def test_a_standby_stopped_or_killed_before_its_handoff_is_replaced_not_waited_on(
        tmp_path, caplog, sig, when):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    argv = [PY, str(script)]
    warm = WarmTrainer(ResumeSettings(), LOG)
    if when == "importing":
        warm.refill(argv, BASE_ENV, str(tmp_path))
        standby = warm._standby.proc
    else:
        standby = _answered_standby(warm, argv, str(tmp_path))
    os.kill(standby.pid, sig)
    wait, took_effect = time.monotonic() + 10, ("T",) if sig == signal.SIGSTOP else ("Z", None)
    while process_state(standby.pid) not in took_effect and time.monotonic() < wait:
        time.sleep(0.01)
    try:
        with caplog.at_level(logging.INFO, logger=LOG.name):
            asked = time.monotonic()
            taken = warm.take(argv, {**BASE_ENV, **PER_ATTEMPT}, str(tmp_path),
                              str(tmp_path / "out.log"))
            took = time.monotonic() - asked
    finally:
        warm.close()
    assert taken is None  # the caller starts the attempt cold
    # Given up without waiting: the kernel says it is stopped or dead. Waited on, a stopped
    # standby would hold the attempt until the heartbeat timeout (minutes); the bound leaves
    # a busy 2-core machine its scheduling delays.
    assert took < 5.0, took
    assert standby.poll() is not None  # and it is gone, not left stopped
    why = "it is stopped" if sig == signal.SIGSTOP else "it has exited"
    assert f"is replaced by a fresh start of the trainer: {why}" in caplog.text


@pytest.mark.slow
def test_a_standby_alive_but_silent_past_its_imports_is_replaced_after_a_short_deadline(
        tmp_path, caplog):
    """Alive to the kernel (sleeping, as a frozen cgroup's or a hung process's is), but never
    reading its stdin: not answering within ANSWER_S is enough to replace it."""
    silent = subprocess.Popen([PY, "-c", "import time; time.sleep(120)"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, start_new_session=True)
    warm = WarmTrainer(ResumeSettings(), LOG)
    warm._standby = _Standby(silent, PY, BASE_ENV, started=time.monotonic() - IMPORT_S)
    with caplog.at_level(logging.INFO, logger=LOG.name):
        asked = time.monotonic()
        warm.ready([PY, "-m", "trainer"], BASE_ENV, str(tmp_path))
        took = time.monotonic() - asked
    assert warm._standby is None and silent.poll() is not None
    assert "did not answer within" in caplog.text and 1.5 < took < 10, took


def _unstick(marker: Path, after_s: float) -> threading.Event:
    """A regression's guard: the stopped standby named in `marker` is SIGKILLed `after_s`
    after the marker was written, so that a run handed to it fails its assertions rather than
    hang. Set the event to call it off."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.5):
            if not marker.exists() or time.time() - marker.stat().st_mtime < after_s:
                continue
            parts = marker.read_text().split()
            pid = int(parts[1]) if len(parts) == 2 else None
            with contextlib.suppress(OSError):
                if pid and process_state(pid) == "T" and MODULE.encode() in Path(
                        f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
            return

    threading.Thread(target=watch, daemon=True).start()
    return done


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGSTOP", "SIGKILL"])
def test_a_relaunch_whose_standby_was_stopped_or_killed_starts_fresh_at_once_and_trains_on(
        instance, tmp_path, mlflow_uri, monkeypatch, sig):
    """Attempt 1 dies once the standby for its relaunch is there, and that standby was stopped
    (SIGSTOP) or killed just before. Attempt 2 is not written to a process that will never
    read it: it starts fresh, in about the time a relaunch takes, and trains on from the
    checkpoint to the end."""
    monkeypatch.delenv(Setting.IN_RUN_RELAUNCH, raising=False)  # the default: relaunch in-run
    key, marker = f"replaced-{sig.lower()}", tmp_path / "crashed"
    res = make_resources(str(tmp_path / "store"), tracking_uri=mlflow_uri)
    unstick = _unstick(marker, 240)
    try:
        out = materialize_run(instance, key, res, training=training_config(
            task="tests.user_tasks:crash_once",
            task_args={"crash_once_at": 15, "crash_marker": str(marker),
                       "crash_after_standby": True, "signal_standby": sig,
                       "step_delay": 0.1}))
    finally:
        unstick.set()
    assert out.success
    crashed_at = marker.stat().st_mtime  # attempt 1 killed itself just after writing it
    assert len(marker.read_text().split()) == 2  # the standby it signalled
    ends = [md for md, _ in partition_events(instance, key, ATTEMPT_ENDED)]
    assert [(e["attempt"], e["failure_class"]) for e in ends] == [
        (1, "killed_by_signal"), (2, "success")]
    # The step advanced: attempt 2 resumed from attempt 1's checkpoint and trained to the end.
    assert ends[1]["resumed_from_step"] == ends[0]["last_committed_step"] == 10
    assert ends[1]["last_committed_step"] == training_config()["max_steps"]
    logs = instance.all_logs(out.run_id)
    started = [r for r in logs if r.user_message.startswith(PROCESS_STARTED)]
    assert [WARM_STARTED in r.user_message for r in started] == [True, False]
    why = "it is stopped" if sig == "SIGSTOP" else "it has exited"
    said = [r.user_message for r in logs if "standby" in r.user_message]
    assert any(f"is replaced by a fresh start of the trainer: {why}" in s for s in said), said
    # From attempt 1's death to attempt 2's process: a relaunch's usual second or so (0.3-0.9 s
    # measured), bounded generously for a busy 2-core machine; not a wait on the standby.
    handoff_s = started[1].timestamp - crashed_at
    assert handoff_s < 10, handoff_s


def _standbys_of_this_process() -> list[int]:
    """The standby trainers this process started that are still there."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == os.getpid() and MODULE.encode() in cmdline:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_a_runs_first_attempt_is_the_standby_its_first_step_started_and_none_outlives_the_run(
        instance, tmp_path, mlflow_uri, monkeypatch):
    resources = make_resources(str(tmp_path / "store"), tracking_uri=mlflow_uri)
    warmed_up = []
    real_warm_up = WarmTrainer.warm_up
    monkeypatch.setattr(WarmTrainer, "warm_up", lambda self, *a: warmed_up.append(a) or
                        real_warm_up(self, *a))
    # A run of the dataset alone trains nothing after it: it starts no standby.
    dataset_only = materialize_run(instance, "first-warm", resources, training=training_config(),
                                   selection=["training_dataset"], with_checks=False)
    assert dataset_only.success and warmed_up == []
    trained = materialize_run(instance, "first-warm", resources, training=training_config())
    assert trained.success
    (started,) = [r.user_message for r in instance.all_logs(trained.run_id)
                  if r.user_message.startswith(PROCESS_STARTED)]
    assert WARM_STARTED in started
    assert not _standbys_of_this_process()
    # A run refused in its first step (bad data) starts none.
    before = len(warmed_up)
    refused = materialize_run(instance, "no-data", resources, training=training_config(
        dataset=str(tmp_path / "not-there")))
    assert not refused.success and len(warmed_up) == before


@pytest.mark.slow
def test_the_runs_end_stops_a_standby_no_training_step_took(tmp_path):
    trainer = TrainerResource()
    trainer.warm_trainer(LOG).warm_up([PY, "-m", "trainer"], BASE_ENV, str(tmp_path))
    (pid,) = _standbys_of_this_process()
    trainer.teardown_after_execution(None)
    assert not pid_alive(pid) and not _standbys_of_this_process()
