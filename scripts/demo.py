"""The whole story on the embedded default (local store, SQLite instance in dagster_home/).

Starts a dagster-daemon, launches a training run, preempts its trainer with SIGTERM, watches
the resume sensor resume it by itself, and prints the run's lineage at the end.
Run it through `bash scripts/demo.sh`, which installs everything first.
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

from dagster import DagsterInstance, RunsFilter  # noqa: E402

from trainer.repo import CheckpointRepo  # noqa: E402
from trainer.storage import open_store  # noqa: E402


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ckpt(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "ckpt_assets", *args], cwd=ROOT, check=True)


def main() -> int:
    run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    instance = DagsterInstance.get()  # creates the SQLite storage before the daemon starts
    runs_of = lambda: list(reversed(instance.get_runs(  # noqa: E731
        filters=RunsFilter(tags={"dagster/partition": run}))))
    logs = Path(os.environ["DAGSTER_HOME"]) / "demo-daemon.log"
    say(f"starting dagster-daemon (instance {os.environ['DAGSTER_HOME']}, log {logs})")
    daemon = subprocess.Popen([str(BIN / "dagster-daemon"), "run", "-w", "workspace.yaml"],
                              cwd=ROOT, start_new_session=True, stdout=open(logs, "w"),
                              stderr=subprocess.STDOUT)
    try:
        say(f"launching training run {run!r} (config scripts/demo_config.json)")
        ckpt("launch", run, "--config", str(ROOT / "scripts" / "demo_config.json"))
        repo = CheckpointRepo(open_store(os.environ["CKPT_STORE_URI"]), "demo", run)
        beat = wait(lambda: (hb := repo.read_heartbeat()) and hb["step"] >= 35 and hb,
                    "the trainer to reach step 35")
        say(f"preempting: SIGTERM to trainer pid {beat['pid']} at step {beat['step']}")
        os.kill(beat["pid"], signal.SIGTERM)
        first = wait(lambda: (r := runs_of()) and r[0].is_finished and r[0],
                     "the preempted run to end")
        say(f"run {first.run_id[:8]} ended {first.status.value}; waiting for the sensor")
        resume = wait(lambda: len(r := runs_of()) > 1 and r[1], "the resume run")
        decided = runs_of()[0].tags
        say(f"resume run {resume.run_id[:8]} launched by {resume.tags.get('dagster/sensor_name')}"
            f": {decided.get('ckpt/decision_reason')}")
        wait(lambda: (hb := repo.read_heartbeat()) and hb["attempt"] == 2 and hb,
             "the resumed trainer's first step")
        say("the resumed trainer is training; waiting for the final model")
        done = wait(lambda: runs_of()[-1].status.value in ("SUCCESS", "FAILURE") and runs_of()[-1],
                    "the run to finish", timeout=600)
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
