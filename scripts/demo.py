"""The whole story on the embedded default (local store, SQLite instance in dagster_home/).

Launches a training run and starts a dagster-daemon to run it. Preempts its trainer alone (SIGTERM to
its pid): the run's worker lives, so the trainer is relaunched in the same Dagster run.
Then terminates the Dagster run itself, as the UI's Terminate button does: the
sensors decide and resume it as a new Dagster run. Prints the run's
lineage at the end. Run it through `bash scripts/demo.sh`, which installs everything first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
os.environ.setdefault("DAGSTER_HOME", str(ROOT / "dagster_home"))
os.environ.setdefault("CKPT_STORE_URI", str(ROOT / "checkpoints"))
sys.path.insert(0, str(ROOT))

from dagster import DagsterInstance  # noqa: E402

from ckpt_assets.base.queries import training_runs_of  # noqa: E402
from trainer.checkpoints.repo import CheckpointRepo  # noqa: E402
from trainer.storage import open_store  # noqa: E402


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ckpt(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "ckpt_assets", *args], cwd=ROOT, check=True)


def main() -> int:
    run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    instance = DagsterInstance.get()  # creates the SQLite storage before the daemon starts
    runs = lambda: list(reversed(training_runs_of(instance, run)))  # noqa: E731
    logs = Path(os.environ["DAGSTER_HOME"]) / "demo-daemon.log"
    # Launched first, then the daemon that runs the queue: the launch says what it sees.
    say(f"launching training run {run!r} (config scripts/demo_config.json)")
    ckpt("launch", run, "--config", str(ROOT / "scripts" / "demo_config.json"))
    say(f"starting dagster-daemon (instance {os.environ['DAGSTER_HOME']}, log {logs})")
    daemon = subprocess.Popen([str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"],
                              cwd=ROOT, start_new_session=True, stdout=open(logs, "w"),
                              stderr=subprocess.STDOUT)
    try:
        repo = CheckpointRepo(open_store(os.environ["CKPT_STORE_URI"]), "demo", run)
        first = _preempt_the_trainer(repo, runs)
        done = _terminate_the_run(instance, repo, runs, first)
        say(f"run {done.run_id[:8]} ended {done.status.value}")
        print()
        ckpt("lineage", run)
        print()
        ckpt("list")
        print()
        say("browse it all in the UI: DAGSTER_HOME=$PWD/dagster_home .venv/bin/dagster dev")
        return 0 if done.status.value == "SUCCESS" else 1
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        daemon.wait(60)


def _preempt_the_trainer(repo: CheckpointRepo, runs):
    """SIGTERM to the trainer alone, as a preemption of its process sends: it commits its
    step and exits 143, and its run worker relaunches it in the same Dagster run."""
    beat = wait(lambda: (hb := repo.read_heartbeat()) and hb["step"] >= 35 and hb,
                "the trainer to reach step 35")
    say(f"preempting the trainer alone: SIGTERM to pid {beat['pid']} at step {beat['step']}")
    os.kill(beat["pid"], signal.SIGTERM)
    again = wait(lambda: (hb := repo.read_heartbeat()) and hb["attempt"] == 2
                 and hb.get("resumed_step") is not None and hb,
                 "the relaunched trainer's first beat")
    (first,) = runs()
    say(f"attempt 2 (pid {again['pid']}) trains in the same Dagster run {first.run_id[:8]}, "
        f"resumed from step {again['resumed_step']}")
    return first


def _terminate_the_run(instance: DagsterInstance, repo: CheckpointRepo, runs, first):
    """The Dagster run terminated, as the UI's Terminate does: the run ends CANCELED and the
    resume sensor launches the next attempt as a new Dagster run."""
    wait(lambda: (hb := repo.read_heartbeat()) and hb["attempt"] == 2 and hb["step"] >= 70,
         "attempt 2 to reach step 70")
    say(f"terminating Dagster run {first.run_id[:8]} (the UI's Terminate)")
    instance.run_launcher.terminate(first.run_id)
    resume = wait(lambda: len(r := runs()) > 1 and r[1], "the resume run")
    decided = instance.get_run_by_id(first.run_id).tags
    say(f"run {first.run_id[:8]} ended {instance.get_run_by_id(first.run_id).status.value}; "
        f"resume run {resume.run_id[:8]} launched by {resume.tags.get('dagster/sensor_name')}: "
        f"{decided.get('ckpt/decision_reason')}")
    say("waiting for the final model")
    return wait(lambda: (r := runs()[-1]).status.value in ("SUCCESS", "FAILURE") and r,
                "the run to finish", timeout=600)


def wait(pred, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            got = pred()
        except (FileNotFoundError, KeyError, TypeError):
            got = None
        if got:
            return got
        time.sleep(0.1)
    raise SystemExit(f"demo: timed out waiting for {what}")


if __name__ == "__main__":
    sys.exit(main())
