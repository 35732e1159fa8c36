"""Launch to first step the README's way, beside the plain script's start.

`dagster dev` (webserver + daemon, as the README starts it) runs from the repository root
on a fresh DAGSTER_HOME made from the shipped `dagster_home/dagster.yaml` (the embedded
default: SQLite, the run queue). As soon as it answers, the benchmark launches `--runs`
training runs one after the other with `python -m ckpt_assets launch NAME --config FILE`
(each a new training run: the command registers it, as a user's first launch of a run
does), the first of them included: it meets a daemon and code server that have served
nothing yet. Each is timed from starting the command to the trainer's first completed step
(the trainer's own heartbeat time). Between launches, the same config runs as a plain
script, `python -m trainer --config FILE` (no Dagster), timed the same way: process start
-> first completed step. Each run finishes before the next one starts.

A figure, not a target. What it sets that a user would not: `heartbeat_seconds: 0` (a
heartbeat every step, so the first step is seen when it happens), a short run (20 steps).

    python benchmarks/bench_launch.py [--runs 4] [--step-s 0.05]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.browser_harness import start_dagster_dev  # noqa: E402
from tests.daemon_harness import training_config  # noqa: E402
from tests.polling import wait_for  # noqa: E402
from trainer.checkpoints.repo import CheckpointRepo  # noqa: E402
from trainer.storage import open_store  # noqa: E402

TIMEOUT_S = 420


def config(name: str, step_s: float) -> dict:
    return training_config(name, max_steps=20, eval_every=0, task_args={"step_delay": step_s},
                           checkpoint={"every_steps": 10, "heartbeat_seconds": 0})


def first_step(store: str, run: str) -> dict:
    def stepped():
        try:
            hb = CheckpointRepo(open_store(store), "default", run).read_heartbeat()
        except Exception:
            return None
        return hb if hb and int(hb.get("step", 0)) >= 1 else None
    return wait_for(stepped, TIMEOUT_S, 0.02, f"{run}'s first step")


def launch(dev, name: str, work: Path, step_s: float) -> tuple[float, float, float]:
    """(command start -> run exists, -> command returned, -> first step), seconds."""
    path = work / f"{name}.json"
    path.write_text(json.dumps(config(name, step_s)))
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_assets", "launch", name, "--config",
                             str(path)], cwd=ROOT, env=dev.env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    exists = wait_for(lambda: dev.runs(name) and time.time(), TIMEOUT_S, 0.02,
                      f"{name}'s Dagster run")
    out = proc.communicate(timeout=TIMEOUT_S)[0]
    returned = time.time()
    if proc.returncode != 0:
        raise SystemExit(f"ckpt-assets launch {name} exited {proc.returncode}:\n"
                         f"{out.decode()[-3000:]}")
    hb = first_step(dev.store, name)
    wait_for(lambda: (rs := dev.runs(name)) and rs[-1].status.value == "SUCCESS", TIMEOUT_S,
             0.2, f"{name}'s run to succeed", lambda: dev.log_tail(40))
    return exists - t0, returned - t0, float(hb["time"]) - t0


def plain(name: str, work: Path, step_s: float) -> float:
    """`python -m trainer --config FILE` on its own: process start -> first step."""
    path, store = work / f"{name}.json", str(work / "plain-store")
    path.write_text(json.dumps(config(name, step_s)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "DAGSTER_"))}
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "--config", str(path), "--store",
                             store], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    hb = first_step(store, name)
    err = proc.communicate(timeout=TIMEOUT_S)[1]
    if proc.returncode != 0:
        raise SystemExit(f"the plain trainer exited {proc.returncode}:\n{err.decode()[-3000:]}")
    return float(hb["time"]) - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=4, help="launches (the first included)")
    ap.add_argument("--step-s", type=float, default=0.05, help="seconds per training step")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_launch_"))
    print(f"bench_launch: {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; `dagster dev` on the shipped "
          "dagster.yaml; each run 20 steps of "
          f"{args.step_s * 1000:.0f} ms, heartbeat_seconds 0 (set: to see the first step)")
    t_dev = time.time()
    dev, url = start_dagster_dev(work, str(work / "store"))
    rows = []
    try:
        print(f"  dagster dev answered after {time.time() - t_dev:.1f} s; launching at once")
        print(f"  {'launch':>6} {'run exists':>11} {'returned':>9} {'first step':>11}   "
              f"{'plain script first step':>24}   ratio")
        for i in range(args.runs):
            exists, returned, first = launch(dev, f"launch-{i}", work, args.step_s)
            alone = plain(f"plain-{i}", work, args.step_s)
            rows.append((first, alone))
            print(f"  {i + 1:>6} {exists:10.2f}s {returned:8.2f}s {first:10.2f}s   "
                  f"{alone:23.2f}s   {first / alone:5.2f}", flush=True)
    finally:
        dev.stop()
        shutil.rmtree(work, ignore_errors=True)
    first, alone = rows[0]
    later = [f for f, _ in rows[1:]]
    med_plain = statistics.median(a for _, a in rows)
    print(f"ckpt-assets launch -> first step: first launch {first:.2f} s "
          f"({first / med_plain:.2f} x the plain script's start)", end="")
    if later:
        print(f"; later launches median {statistics.median(later):.2f} s "
              f"({statistics.median(later) / med_plain:.2f} x)", end="")
    print(f"; plain `python -m trainer --config` -> first step median {med_plain:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
