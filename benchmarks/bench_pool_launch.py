"""Launch -> first training step with the run pool's launcher, against Dagster's default one
and against the same trainer started as a plain `python -m trainer` without Dagster.

Two temporary instances without the run queue (launching starts the run), one with
`ckpt_assets.runs.pool_launcher.PoolRunLauncher` (tests/orchestrator/pool_launcher_instance.yaml),
one with the default launcher, one store. Each has its workspace loaded once (its code
server up), as a running daemon has, and one warm-up run that is not counted (the pool's
server starts then). Then `--runs` runs each, interleaved, one at a time: the clock starts
before the run is created and submitted (`ckpt_assets.runs.submit.submit`) and stops at the
trainer's first step in its heartbeat. Its parts: "worker start" is RUN_STARTING -> RUN_START
(the run worker's own start-up: what the pool removes), then RUN_START -> the trainer's
process started (the run's first step and the attempt's set-up, in the run worker), then
the trainer's own start to its first step. "plain" is the run's trainer as a user starts
it by hand (`python -m trainer --config FILE --store DIR`, the command every attempt of
these runs runs, less the orchestrator's contract): its process started -> its first step.
Each run is waited for to its end before the next starts. With standby trainers on (the
default; `CKPT_WARM_TRAINER=0` turns them off for both launchers), the pool hands a training
run the spare worker whose standby trainer is warm.

    python benchmarks/bench_pool_launch.py [--runs 3] [--steps 10] [--step-s 0.01]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dagster as dg  # noqa: E402

from ckpt_assets.attempt.process import PROCESS_STARTED  # noqa: E402
from ckpt_assets.runs.registration import register_training_run  # noqa: E402
from ckpt_assets.runs.submit import open_training_location, plan_launch, submit  # noqa: E402
from tests.daemon_harness import fresh_instance, training_config  # noqa: E402
from tests.polling import wait_for  # noqa: E402
from trainer.storage import open_store  # noqa: E402

POOL_YAML = ROOT / "tests" / "orchestrator" / "pool_launcher_instance.yaml"
# Launch -> first step through Dagster against `python -m trainer` start -> first step.
TARGET = 1.2
COLUMNS = ("launch->first step", "worker start", "RUN_START->trainer", "trainer->first step")
DEFAULT_LAUNCHER = {"module": "dagster.core.launcher", "class": "DefaultRunLauncher"}


def instance_yaml(work: Path, pooled: bool) -> Path:
    raw = yaml.safe_load(POOL_YAML.read_text())
    if not pooled:
        raw["run_launcher"] = DEFAULT_LAUNCHER
    path = work / ("pool.yaml" if pooled else "default.yaml")
    path.write_text(yaml.safe_dump(raw))
    return path


def heartbeat(store: str, run: str) -> dict | None:
    try:
        return json.loads((Path(store) / "default" / run / "heartbeat.json").read_text())
    except (OSError, ValueError):
        return None


def marks(instance: dg.DagsterInstance, run_id: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in instance.all_logs(run_id):
        if e.dagster_event and e.dagster_event.event_type.name in ("RUN_STARTING", "RUN_START"):
            out.setdefault(e.dagster_event.event_type.name, e.timestamp)
        elif (e.user_message or "").startswith(PROCESS_STARTED):
            out.setdefault("spawned", e.timestamp)
    return out


def one_run(instance, loc, store: str, name: str, args) -> tuple[float, ...]:
    """(launch -> first step, the run worker's start-up, RUN_START -> trainer started,
    trainer started -> first step) of one run, waited to its end."""
    cfg = training_config(name, max_steps=args.steps, eval_every=0,
                          task_args={"step_delay": args.step_s},
                          checkpoint={"every_steps": args.steps, "heartbeat_seconds": 0})
    register_training_run(open_store(store), name, cfg, instance=instance)
    t0 = time.time()
    run = submit(instance, loc, plan_launch(instance, name, force=False)).run
    first = wait_for(lambda: (hb := heartbeat(store, name)) and int(hb.get("step", 0)) >= 1
                     and hb, 300, 0.01, f"{name}'s first step")
    done = wait_for(lambda: (r := instance.get_run_by_id(run.run_id)).is_finished and r, 300,
                    0.1, f"{name}'s run to end")
    if done.status != dg.DagsterRunStatus.SUCCESS:
        raise SystemExit(f"run {name} ended {done.status}; see its events in {instance.root_directory}")
    m = marks(instance, run.run_id)
    return (float(first["time"]) - t0, m["RUN_START"] - m["RUN_STARTING"],
            m["spawned"] - m["RUN_START"], float(first["time"]) - m["spawned"])


def one_plain(store: str, work: Path, name: str, args) -> tuple[float, ...]:
    """(start -> first step) of the same trainer as a plain process, waited to its end."""
    cfg = training_config(name, max_steps=args.steps, eval_every=0,
                          task_args={"step_delay": args.step_s},
                          checkpoint={"every_steps": args.steps, "heartbeat_seconds": 0})
    path = work / f"{name}.json"
    path.write_text(json.dumps(cfg))
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "trainer", "--config", str(path),
                             "--store", store], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.STDOUT)
    first = wait_for(lambda: (hb := heartbeat(store, name)) and int(hb.get("step", 0)) >= 1
                     and hb, 300, 0.01, f"{name}'s first step")
    if proc.wait() != 0:
        raise SystemExit(f"the plain trainer of {name} exited {proc.returncode}")
    return (float(first["time"]) - t0,)


def columns(values) -> str:
    """The figures named; a plain run has the first alone (its start -> first step)."""
    return ", ".join(f"{c} {v:.2f}s" for c, v in zip(COLUMNS, values, strict=False))


def stop_pool(home: Path) -> None:
    try:
        os.kill(json.loads((home / "run_pool" / "server.json").read_text())["pid"],
                signal.SIGTERM)
    except (OSError, ValueError, KeyError):
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--step-s", type=float, default=0.01)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_pool_"))
    store = str(work / "store")
    homes = {}
    for kind in ("default", "pool"):
        home, env, _ = fresh_instance(work / kind, store,
                                      instance_yaml=instance_yaml(work, kind == "pool"))
        homes[kind] = home
    os.environ.update({"CKPT_STORE_URI": store, "DAGSTER_HOME": str(homes["default"]),
                       "MLFLOW_TRACKING_URI": f"sqlite:///{homes['default'] / 'mlflow.db'}"})
    rows: dict[str, list[tuple[float, ...]]] = {"plain": [], "default": [], "pool": []}
    print(f"bench_pool_launch: {args.runs} runs each of {args.steps} steps of "
          f"{args.step_s * 1000:.0f} ms, interleaved, after one warm-up run each; workdir {work}")
    try:
        with ExitStack() as stack:
            ctx = {}
            for kind, home in homes.items():
                instance = stack.enter_context(dg.DagsterInstance.from_config(str(home)))
                ctx[kind] = (instance, stack.enter_context(open_training_location(instance)))
            for i in range(-1, args.runs):
                for kind in rows:
                    name = f"{kind}-{i + 1}"
                    row = (one_plain(store, work, name, args) if kind == "plain"
                           else one_run(*ctx[kind], store, name, args))
                    if i >= 0:
                        rows[kind].append(row)
                        print(f"{kind:>8} run {i}: {columns(row)}", flush=True)
    finally:
        stop_pool(homes["pool"])
        shutil.rmtree(work, ignore_errors=True)
    med = {k: [statistics.median(r[c] for r in v) for c in range(len(v[0]))]
           for k, v in rows.items()}
    for kind, values in med.items():
        print(f"median {kind:>8}: {columns(values)}")
    print("ratio pool/default: " + ", ".join(
        f"{c} {p / d:.2f}" for c, p, d in zip(COLUMNS, med["pool"], med["default"], strict=True)))
    for kind in ("pool", "default"):
        ratio = med[kind][0] / med["plain"][0]
        verdict = "MET" if ratio <= TARGET else "NOT MET"
        print(f"ratio {kind}/plain: launch->first step {ratio:.2f} (target <= {TARGET}: "
              f"{verdict if kind == 'pool' else 'the default launcher, for comparison'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
