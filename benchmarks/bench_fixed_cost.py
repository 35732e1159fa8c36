"""Fixed orchestration cost of a training run: `ckpt-assets launch` -> first training step,
plus last training step -> Dagster run success, and where each second goes.

A real dagster-daemon (tests.daemon_harness.Daemon, the project's dagster.yaml: the run
queue) runs `--runs` short runs one after the other, each a new training run launched with
`ckpt-assets launch NAME --config FILE` (so each registers its config, as a first launch
does). A warm-up run first, not counted, so that the daemon's code server is up and
the figures are those of a deployment that is already running. The first and last steps are
the trainer's own heartbeat times; the rest are the run's record and event log.

    python benchmarks/bench_fixed_cost.py [--runs 4]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt_assets.attempt.process import PROCESS_STARTED  # noqa: E402
from tests.daemon_harness import PROJECT_WORKSPACE, Daemon, training_config  # noqa: E402
from tests.polling import wait_for  # noqa: E402

TARGET_S = 3.0
COLUMNS = {
    "cli": "the launch command, start to exit",
    "queued": "launch -> run created (registration, submission)",
    "dequeue": "run created -> RUN_STARTING",
    "worker": "RUN_STARTING -> RUN_START (a fresh run worker loads Dagster and the code)",
    "prepare": "RUN_START -> training process started (training_dataset, the step's setup)",
    "trainer": "training process started -> its first completed step",
    "finish": "last step -> model_checkpoint's end (final commit, history, MLflow)",
    "final_model": "model_checkpoint's end -> final_model's end (load, evaluate, log)",
    "succeed": "final_model's end -> run success (the checks, the run's end)",
}


def marks(daemon: Daemon, run_id: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in daemon.instance.all_logs(run_id):
        ev = e.dagster_event
        if ev is not None:
            name = ev.event_type.name
            if name in ("RUN_STARTING", "RUN_START"):
                out.setdefault(name, e.timestamp)
            elif name == "STEP_SUCCESS":
                out[f"end:{ev.step_key}"] = e.timestamp
        elif (e.user_message or "").startswith(PROCESS_STARTED):
            out.setdefault("spawned", e.timestamp)
    return out


def one_run(daemon: Daemon, name: str, work: Path, step_s: float) -> dict[str, float]:
    cfg = training_config(name, max_steps=20, eval_every=0, task_args={"step_delay": step_s},
                          checkpoint={"every_steps": 10, "heartbeat_seconds": 0})
    t0 = time.time()
    daemon.launch(name, cfg, work)
    t_cli = time.time() - t0
    first = wait_for(lambda: (hb := daemon.heartbeat(name)) and int(hb.get("step", 0)) >= 1 and hb,
                     300, 0.02, f"{name}'s first step")
    wait_for(lambda: (rs := daemon.runs(name)) and rs[-1].status.value == "SUCCESS", 300, 0.1,
             f"{name}'s run to succeed")
    run = daemon.runs(name)[-1]
    rec = daemon.instance.get_run_record_by_id(run.run_id)
    m = marks(daemon, run.run_id)
    created, last = rec.create_timestamp.timestamp(), float(daemon.heartbeat(name)["time"])
    row = {"cli": t_cli, "queued": created - t0, "dequeue": m["RUN_STARTING"] - created,
           "worker": m["RUN_START"] - m["RUN_STARTING"], "prepare": m["spawned"] - m["RUN_START"],
           "trainer": float(first["time"]) - m["spawned"],
           "finish": m["end:model_checkpoint"] - last,
           "final_model": m["end:final_model"] - m["end:model_checkpoint"],
           "succeed": rec.end_time - m["end:final_model"]}
    row["launch->first"] = float(first["time"]) - t0
    row["last->success"] = rec.end_time - last
    row["fixed"] = row["launch->first"] + row["last->success"]
    return row


def interpreter_s(code: str, n: int = 3) -> float:
    """Median wall time of a fresh `python -c CODE`: what any launch command (dagster) or
    trainer process (torch) pays before its own first line runs."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# What every trainer runs before its first step, whoever wrote its loop: torch, and the
# Dynamo and Inductor that torch.optim imports when an optimizer takes its parameters
# (`torch._disable_dynamo`; about 800 modules).
TRAINER_FLOOR = ("import torch; torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())")


def print_floor(med: dict[str, float]) -> None:
    """What no ckpt-assets change can remove from this machine's fixed cost: Dagster's own
    run machinery (the queue, the run worker's spawn and start, the run's end), measured on
    these runs, and the two fresh interpreters a launch needs (the launch command's, with
    Dagster imported; the trainer's, with torch imported and an optimizer made) unless they
    are started earlier."""
    dagster_own = med["dequeue"] + med["worker"] + med["succeed"]
    cli, trainer = interpreter_s("import dagster"), interpreter_s(TRAINER_FLOOR)
    print(f"floor: Dagster's run machinery {dagster_own:.2f}s (dequeue + worker + succeed) + "
          f"a fresh interpreter importing dagster {cli:.2f}s + one importing torch and "
          f"making an optimizer {trainer:.2f}s = {dagster_own + cli + trainer:.2f}s; "
          f"ckpt-assets' own part of "
          f"the median: {med['fixed'] - dagster_own - cli - trainer:.2f}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--step-s", type=float, default=0.05,
                    help="seconds per training step (20 steps): 0.5 gives the run worker the "
                         "10 s of training a real run gives it to import the run's last "
                         "steps' libraries in the background (ckpt_assets.attempt.prefetch)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_fixed_"))
    daemon = Daemon.start(work, str(work / "store"), workspace=PROJECT_WORKSPACE)
    try:
        print(f"bench_fixed_cost: {args.runs} runs of 20 steps of {args.step_s * 1000:.0f} ms, "
              f"each launched with "
              f"--config, after one warm-up run; workdir {work}")
        one_run(daemon, "warm-up", work, args.step_s)
        rows = [one_run(daemon, f"fixed-{i}", work, args.step_s) for i in range(args.runs)]
        keys = list(rows[0])
        print("run " + " ".join(f"{k:>13}" for k in keys))
        for i, r in enumerate(rows):
            print(f"{i:>3} " + " ".join(f"{r[k]:13.2f}" for k in keys))
        med = {k: statistics.median(r[k] for r in rows) for k in keys}
        print("med " + " ".join(f"{med[k]:13.2f}" for k in keys))
        for k, what in COLUMNS.items():
            print(f"  {k:<12} {what}")
        print_floor(med)
        print(f"target: fixed orchestration cost (launch -> first step + last step -> run "
              f"success) <= {TARGET_S:.0f}s: {'MET' if med['fixed'] <= TARGET_S else 'MISSED'} "
              f"({med['fixed']:.2f}s median)")
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
