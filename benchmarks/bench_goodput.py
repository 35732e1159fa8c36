"""Goodput under failures: one job, one seeded failure schedule, ckpt-assets against the
Dagster run-retries baseline, side by side.

A real dagster-daemon (tests.daemon_harness.Daemon) trains a job of `--job-seconds` of
useful step time (the toy task, `step_delay` seconds a step) while a seeded schedule of
failures strikes it: exponential inter-arrival times of mean `--mtbf` seconds, counted from
the job's first completed step; each failure a SIGKILL of the trainer process or of its run
worker (the process that runs the step, the trainer's parent), drawn with probability
`--worker-share`. A failure due while no trainer is alive (between attempts) strikes the
next one as soon as it is up. The same schedule then strikes the same job as a Dagster user
runs it today (benchmarks/goodput_baseline.py): an op that runs the trainer, Dagster's own
run retries from failure (`dagster/max_retries`), no checkpoint awareness, so every retry
starts from step 0. The baseline stops at `--baseline-cap` seconds if it has not finished.

ckpt-assets runs as a user runs it: the shipped defaults (in-run relaunch of a killed
trainer, the sensors for a killed run worker, the policy's budgets and back-off, none after
progress, synchronous saves) and the one key docs/failures.md asks of a job on machines
that fail often, `checkpoint.mtbf_seconds` = `--mtbf`, which turns the interval to
`every_seconds: auto` (Young/Daly from the measured stall and the experiment's failure
history). It sets one thing more, for measurement, and prints it: a heartbeat after every
step, so the sampler sees each step. `--backoff-base` sets CKPT_BACKOFF_BASE_S.

Printed for each: effective training time ratio (useful step time / wall time, both from the
first completed step to the last), lost steps (trained, then redone), the restart cost per
failure; and the Young/Daly prediction from the measured stall C, the MTBF and the measured
restart cost R:

    T = sqrt(2 * C * MTBF);  goodput ~= 1 - C/T - T/(2 * MTBF) - R/MTBF

    python benchmarks/bench_goodput.py [--job-seconds 600] [--mtbf 120] [--seed 0]
        [--worker-share 0.5] [--step-delay 0.2] [--baseline-cap 1800]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt_assets.base.events import CHECKPOINT, STATE, partition_events  # noqa: E402
from ckpt_assets.lifecycle.policy import PolicyConfig  # noqa: E402
from ckpt_assets.lifecycle.settings import Setting  # noqa: E402
from tests.daemon_harness import (  # noqa: E402
    PROJECT_WORKSPACE,
    ROOT,
    Daemon,
    trainer_parent,
)
from tests.polling import WaitTimeout, pid_alive, wait_for  # noqa: E402
from trainer.base.interval import young_daly  # noqa: E402
from trainer.checkpoints.repo import CheckpointRepo  # noqa: E402
from trainer.storage import open_store  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_resume_latency import BenchError, poll  # noqa: E402
from goodput_baseline import JOB, store_of, train_from_scratch  # noqa: E402

RUN = "bench-goodput"
EXPERIMENT = "default"
BASELINE_FILE = Path(__file__).resolve().parent / "goodput_baseline.py"
POLL_S = 0.02
FORMULA = "T = sqrt(2*C*MTBF); goodput ~= 1 - C/T - T/(2*MTBF) - R/MTBF"
RESTART_FROM_ZERO = "E[wall] = (MTBF + R) * (exp(L/MTBF) - 1)"


class Strike(StrEnum):
    TRAINER = "trainer"  # SIGKILL of the trainer process
    WORKER = "worker"  # SIGKILL of its run worker (the trainer's parent)


@dataclass(frozen=True)
class Failure:
    at_s: float  # seconds after the job's first completed step
    strike: Strike


def failure_schedule(seed: int, mtbf_s: float, horizon_s: float,
                     worker_share: float) -> list[Failure]:
    """Failures up to `horizon_s`: exponential inter-arrival times of mean `mtbf_s`, each
    a run-worker kill with probability `worker_share`; the same seed, the same schedule."""
    if mtbf_s <= 0 or not 0 <= worker_share <= 1:
        raise ValueError(f"mtbf_s must be above 0 and worker_share in [0, 1]; got {mtbf_s}, "
                         f"{worker_share}")
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            return out
        out.append(Failure(round(t, 3),
                           Strike.WORKER if rng.random() < worker_share else Strike.TRAINER))


def predicted_goodput(stall_s: float, interval_s: float, mtbf_s: float,
                      restart_s: float) -> float:
    """First-order Young/Daly goodput: the share of wall time left after checkpoint stalls
    (C/T), work redone after a failure (half an interval on average, T/(2*MTBF)) and the
    restart itself (R/MTBF)."""
    return 1.0 - stall_s / interval_s - interval_s / (2.0 * mtbf_s) - restart_s / mtbf_s


def restart_from_zero_wall(job_s: float, mtbf_s: float, restart_s: float) -> float:
    """Expected wall time of a job of `job_s` that restarts from zero after each failure
    (Poisson failures of mean `mtbf_s`, `restart_s` of downtime each)."""
    return (mtbf_s + restart_s) * math.expm1(job_s / mtbf_s)


# -- one job under one schedule -------------------------------------------------------------

@dataclass(eq=False)  # a thread: hashed by identity
class Sampler(threading.Thread):
    """Samples the live trainer's heartbeat every POLL_S: per attempt (keyed by where the
    beat comes from), the step it resumed from, the steps it completed and when."""

    beat: object  # () -> (key, heartbeat dict) or None
    steps: dict = field(default_factory=dict)  # key -> {step: step_time}
    resumed: dict = field(default_factory=dict)  # key -> resumed_step
    order: list = field(default_factory=list)  # keys, first seen first
    halt: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        super().__init__(daemon=True)

    def run(self) -> None:
        while not self.halt.is_set():
            self.sample()
            time.sleep(POLL_S)

    def sample(self):
        got = self.beat()
        if not got:
            return None
        key, hb = got
        if hb.get("attempt") is None or hb.get("step_time") is None:
            return None
        if key not in self.steps:
            self.steps[key], self.resumed[key] = {}, int(hb.get("resumed_step") or 0)
            self.order.append(key)
        step = int(hb["step"])
        if step > self.resumed[key]:
            self.steps[key].setdefault(step, float(hb["step_time"]))
        return key, hb

    def first_step(self, key) -> tuple[int, float] | None:
        s = self.steps.get(key)
        return min(s.items()) if s else None

    def step_seconds(self) -> float:
        """Median time of one step: consecutive completed steps of one attempt."""
        gaps = []
        for s in self.steps.values():
            items = sorted(s.items())
            gaps += [(t2 - t1) / (n2 - n1) for (n1, t1), (n2, t2) in zip(items, items[1:], strict=False)
                     if n2 > n1]
        return statistics.median(gaps) if gaps else float("nan")


@dataclass
class Kill:
    failure: Failure
    at: float  # epoch seconds
    key: object  # the attempt struck
    deferred_s: float  # how long the failure waited for a live trainer


class Job:
    """One way of running the job: how to launch it, where its trainer's beat is, when it
    is done."""

    name = ""

    def launch(self) -> None: ...
    def beat(self): ...
    def done(self) -> bool: ...


def live(hb: dict | None) -> bool:
    return bool(hb and hb.get("attempt") is not None and hb.get("ended") is None
                and pid_alive(int(hb["pid"])))


def strike(job: Job, sampler: Sampler, f: Failure, due: float, timeout: float) -> Kill | None:
    """Strike the live trainer (or its run worker) at `due`, or as soon as one is up."""
    def alive():
        if job.done():
            return "done"
        got = sampler.sample()
        return got if got and live(got[1]) and int(got[1]["step"]) > \
            int(got[1].get("resumed_step") or 0) else None

    got = poll(alive, f"a live trainer to strike ({f.strike})", timeout)
    if got == "done":
        return None
    key, hb = got
    now = time.time()
    pid = int(hb["pid"])
    target = trainer_parent(pid) if f.strike is Strike.WORKER else pid
    try:
        os.kill(target, signal.SIGKILL)
    except ProcessLookupError:
        return strike(job, sampler, f, due, timeout)  # it ended this instant: the next one
    return Kill(f, now, key, max(0.0, now - due))


def drive(job: Job, schedule: list[Failure], cap_s: float, timeout: float):
    """Launch `job`, strike it by `schedule` and wait for it to finish (or `cap_s` after its
    first step). Returns (sampler, kills, first step time, finished)."""
    sampler = Sampler(job.beat)
    job.launch()
    first = poll(lambda: sampler.sample() and sampler.order and
                 sampler.first_step(sampler.order[0]), f"{job.name}: the first step", timeout)
    t0 = first[1]
    sampler.start()
    kills: list[Kill] = []
    try:
        for f in schedule:
            due = t0 + f.at_s
            if due - t0 > cap_s:
                break
            while time.time() < due and not job.done():
                time.sleep(min(0.05, max(0.0, due - time.time())))
            if job.done():
                break
            k = strike(job, sampler, f, due, timeout)
            if k is None:
                break
            kills.append(k)
            print(f"  {job.name}: {f.strike:<7} kill at +{k.at - t0:7.1f}s (due +{f.at_s:7.1f}s)",
                  flush=True)
        try:
            wait_for(job.done, max(1.0, t0 + cap_s - time.time()), 0.5, f"{job.name} to finish")
        except WaitTimeout:
            pass
    finally:
        sampler.halt.set()
        sampler.join(5)
    return sampler, kills, t0, job.done()


@dataclass
class Outcome:
    finished: bool
    wall_s: float  # first completed step -> last (or -> the cap)
    useful_s: float
    goodput: float
    lost_steps: int
    restarts: list[float]  # per kill: downtime before the next attempt's first step (nan:
    # no next attempt was seen)
    furthest: int


def outcome(sampler: Sampler, kills: list[Kill], t0: float, finished: bool, max_steps: int,
            cap_s: float) -> Outcome:
    step_s = sampler.step_seconds()
    last = max((max(s.items()) for s in sampler.steps.values() if s), default=(0, t0))
    furthest = last[0]
    # The steps each attempt covered (from the step it resumed from to its last), so a
    # step the sampler missed between two samples still counts; beyond the furthest step,
    # they were trained twice.
    covered = sum((max(s) - sampler.resumed[k]) for k, s in sampler.steps.items() if s)
    lost = covered - furthest
    restarts = []
    for k in kills:
        nxt = sampler.order.index(k.key) + 1
        first = sampler.first_step(sampler.order[nxt]) if nxt < len(sampler.order) else None
        restarts.append(first[1] - k.at - step_s if first else float("nan"))
    if finished and furthest >= max_steps:
        wall = last[1] - sampler.first_step(sampler.order[0])[1]
        useful = (max_steps - 1) * step_s
    else:
        wall, useful = cap_s, 0.0  # nothing useful until it finishes
    return Outcome(finished, wall, useful, useful / wall if wall > 0 else float("nan"), lost,
                   restarts, furthest)


# -- the two ways of running the job ---------------------------------------------------------

class Throttled:
    """A Dagster query asked every poll, answered at most every `every` seconds."""

    def __init__(self, fn, every: float = 0.5):
        self.fn, self.every, self.at, self.value = fn, every, 0.0, None

    def __call__(self):
        if time.monotonic() - self.at >= self.every:
            self.value, self.at = self.fn(), time.monotonic()
        return self.value


class CkptAssetsJob(Job):
    name = "ckpt-assets"

    def __init__(self, daemon: Daemon, cfg: dict, work: Path):
        self.daemon, self.cfg, self.work = daemon, cfg, work
        self.done = Throttled(self._done)
        self.launched_at = self.finished_at = None

    def launch(self) -> None:
        self.launched_at = time.time()
        self.daemon.launch(RUN, self.cfg, self.work)

    def beat(self):
        hb = self.daemon.heartbeat(RUN)
        return (("attempt", hb.get("attempt")), hb) if hb else None

    def _done(self) -> bool:
        runs = self.daemon.runs(RUN)
        if runs and runs[-1].status.value == "SUCCESS":
            rec = self.daemon.instance.get_run_record_by_id(runs[-1].run_id)
            self.finished_at = rec.end_time if rec else time.time()
            return True
        return False

    def checkpoints(self) -> list[dict]:
        return [md for md, _ in partition_events(self.daemon.instance, RUN, CHECKPOINT)]

    def decisions(self) -> list[str]:
        """Every resume decision, in the sensors' and the step's own words, oldest first."""
        said = [md for md, _ in partition_events(self.daemon.instance, RUN, STATE)
                if md.get("reason")]
        return [f"{n}. {'in its run' if md.get('relaunched_in_run') else 'new run'}: "
                f"{md['reason']}" for n, md in enumerate(said, 1)]


class RunRetriesJob(Job):
    name = "run retries"

    def __init__(self, daemon: Daemon, workspace: Path, config_path: Path, store_root: Path,
                 run: str):
        self.daemon, self.workspace, self.config_path = daemon, workspace, config_path
        self.store_root, self.run = store_root, run
        self.done = Throttled(self._done)
        self.newest = Throttled(self._newest)

    def _runs(self):
        from dagster import RunsFilter

        return self.daemon.instance.get_runs(filters=RunsFilter(job_name=JOB))

    def _newest(self):
        runs = self._runs()
        return runs[0].run_id if runs else None

    def _done(self) -> bool:
        return any(r.status.value == "SUCCESS" for r in self._runs())

    def launch(self) -> None:
        run_config = {"ops": {train_from_scratch.name: {"config": {
            "config": str(self.config_path), "store_root": str(self.store_root)}}}}
        res = self.daemon.dagster(
            "job", "launch", "-w", str(self.workspace), "-j", JOB,
            "--config-json", json.dumps(run_config),
            "--tags", json.dumps({"dagster/max_retries": "100000",
                                  "dagster/retry_strategy": "FROM_FAILURE"}))
        if res.returncode != 0:
            raise BenchError(f"dagster job launch failed: {res.stdout}{res.stderr}")

    def beat(self):
        run_id = self.newest()
        if run_id is None:
            return None
        try:
            repo = CheckpointRepo(open_store(str(store_of(str(self.store_root), run_id))),
                                  EXPERIMENT, self.run)
            hb = repo.read_heartbeat()
        except Exception:
            return None
        return (run_id, hb) if hb else None


def baseline_daemon(work: Path, store: str) -> tuple[Daemon, Path]:
    """A daemon on an instance with Dagster's run retries on, loading the baseline job."""
    import yaml

    from tests.daemon_harness import EMBEDDED_INSTANCE_YAML

    inst = yaml.safe_load(EMBEDDED_INSTANCE_YAML.read_text())
    inst["run_retries"] = {"enabled": True, "max_retries": 0}  # the run's tag sets its own
    (work / "instance.yaml").write_text(yaml.safe_dump(inst))
    ws = work / "workspace.yaml"
    ws.write_text(yaml.safe_dump({"load_from": [{"python_file": {
        "relative_path": str(BASELINE_FILE), "attribute": "defs",
        "location_name": "goodput_baseline", "working_directory": str(ROOT)}}]}))
    return Daemon.start(work, store, instance_yaml=work / "instance.yaml", workspace=ws), ws


# -- main -------------------------------------------------------------------------------------

# What the benchmark sets that a user would not, printed with its figures: a beat after every
# step, so that the sampler sees each step when it happens (a cost to ckpt-assets, if any).
MEASUREMENT_ONLY = {"heartbeat_seconds": 0}


def configs(args) -> tuple[dict, dict, int]:
    """The job as a user writes it: the shipped defaults, and the one key the failures doc
    asks of a job on machines that fail often, `checkpoint.mtbf_seconds`."""
    max_steps = max(2, round(args.job_seconds / args.step_delay))
    common = {"max_steps": max_steps, "task_args": {"step_delay": args.step_delay}}
    ours = {"run": RUN, **common,
            "checkpoint": {"mtbf_seconds": args.mtbf, **MEASUREMENT_ONLY}}
    plain = {"run": RUN + "-plain", **common,
             "checkpoint": {"every_steps": None, "on_epoch_end": False, "on_best": False,
                            **MEASUREMENT_ONLY}}
    return ours, plain, max_steps


def run_ours(args, schedule, cfg, max_steps, work: Path):
    # The policy's own budgets and back-off (the harness shortens the back-off for tests).
    env = {Setting.BACKOFF_BASE_S.value: str(PolicyConfig().backoff_base_s)}
    if args.backoff_base is not None:
        env[Setting.BACKOFF_BASE_S.value] = str(args.backoff_base)
    daemon = Daemon.start(work / "ours", str(work / "ours" / "store"), extra_env=env,
                          workspace=PROJECT_WORKSPACE)
    try:
        job = CkptAssetsJob(daemon, cfg, work)
        sampler, kills, t0, finished = drive(job, schedule, args.job_seconds * 20, args.timeout)
        out = outcome(sampler, kills, t0, finished, max_steps, args.job_seconds * 20)
        time.sleep(1)  # the last checkpoints' events
        ckpts = job.checkpoints()
        e2e = (job.finished_at - job.launched_at) if job.finished_at else float("nan")
        runs = len(daemon.runs(RUN))
        print("  decisions:\n" + "\n".join(f"    {d}" for d in job.decisions()), flush=True)
        return out, kills, sampler, ckpts, e2e, runs
    except BaseException:
        print("\n--- daemon log tail ---\n" + daemon.log_tail(60), file=sys.stderr)
        raise
    finally:
        daemon.stop()


def run_baseline(args, schedule, cfg, max_steps, work: Path):
    base = work / "baseline"
    base.mkdir(parents=True)
    (base / "config.json").write_text(json.dumps(cfg))
    daemon, ws = baseline_daemon(base, str(base / "unused-store"))
    try:
        job = RunRetriesJob(daemon, ws, base / "config.json", base / "stores", cfg["run"])
        sampler, kills, t0, finished = drive(job, schedule, args.baseline_cap, args.timeout)
        return outcome(sampler, kills, t0, finished, max_steps, args.baseline_cap), kills, \
            sampler, len(job._runs())
    except BaseException:
        print("\n--- daemon log tail ---\n" + daemon.log_tail(60), file=sys.stderr)
        raise
    finally:
        for r in daemon.instance.get_runs():  # a capped baseline is still training
            if r.status.value in ("QUEUED", "STARTING", "STARTED"):
                daemon.instance.run_launcher.terminate(r.run_id)
        daemon.stop()


def mean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]  # not NaN
    return statistics.mean(xs) if xs else float("nan")


def median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]  # not NaN
    return statistics.median(xs) if xs else float("nan")


def report(args, schedule, ours, base, max_steps) -> None:
    (o, o_kills, o_sampler, ckpts, e2e, o_runs) = ours
    stalls = [m["blocking_seconds"] for m in ckpts if m.get("blocking_seconds") is not None]
    intervals = [m["interval_seconds"] for m in ckpts if m.get("interval_seconds")]
    c, t_used = median(stalls), median(intervals)
    # The mean: the formula charges each failure its expected cost, and the two kinds of
    # failure cost very differently.
    r = mean(o.restarts)
    seen_mtbf = o.wall_s / len(o_kills) if o_kills else float("inf")
    step_s = o_sampler.step_seconds()
    by = {s: median([x for k, x in zip(o_kills, o.restarts, strict=True)
                     if k.failure.strike is s]) for s in Strike}

    def kinds(kills):
        n = {s: sum(1 for k in kills if k.failure.strike is s) for s in Strike}
        return f"{len(kills)} ({n[Strike.TRAINER]} trainer, {n[Strike.WORKER]} worker)"

    rows = [("finished", "yes" if o.finished else "NO", "yes" if base and base[0].finished
             else f"no, capped at {args.baseline_cap:.0f}s" if base else "-"),
            ("failures struck", kinds(o_kills), kinds(base[1]) if base else "-"),
            ("Dagster runs", str(o_runs), str(base[3]) if base else "-"),
            ("wall, first step -> last step", f"{o.wall_s:.1f}s",
             f"{base[0].wall_s:.1f}s" if base else "-"),
            ("useful step time", f"{o.useful_s:.1f}s", f"{base[0].useful_s:.1f}s" if base else "-"),
            ("EFFECTIVE TRAINING TIME RATIO", f"{o.goodput:.3f}",
             f"{base[0].goodput:.3f}" if base else "-"),
            ("lost steps (trained, then redone)", str(o.lost_steps),
             str(base[0].lost_steps) if base else "-"),
            ("furthest step", f"{o.furthest}/{max_steps}",
             f"{base[0].furthest}/{max_steps}" if base else "-"),
            ("restart cost per failure, mean", f"{r:.2f}s",
             f"{mean(base[0].restarts):.2f}s" if base else "-")]
    print(f"\n{'':<36}{'ckpt-assets':>22}{'Dagster run retries':>28}")
    for name, a, b in rows:
        print(f"{name:<36}{a:>22}{b:>28}")
    print(f"  restart cost by kind (ckpt-assets, medians): trainer killed {by[Strike.TRAINER]:.2f}s "
          f"(in-run relaunch), run worker killed {by[Strike.WORKER]:.2f}s (sensor, new run)")
    print(f"  launch -> run success (ckpt-assets, all orchestration included): {e2e:.1f}s for "
          f"{o.useful_s:.1f}s of useful step time: {o.useful_s / e2e:.3f}")
    print(f"  median step {step_s * 1000:.1f} ms; schedule: {len(schedule)} failures drawn in "
          f"{max(args.baseline_cap, 20 * args.job_seconds):.0f}s (seed {args.seed}), those due "
          f"before each job finished struck; failures due between attempts waited "
          f"for the next trainer: ckpt-assets "
          f"{sum(1 for k in o_kills if k.deferred_s > 0.5)}, baseline "
          f"{sum(1 for k in base[1] if k.deferred_s > 0.5) if base else '-'}")

    print(f"\nYoung/Daly: {FORMULA}")
    print(f"  C = {c * 1000:.2f} ms (median stall per checkpoint on the training thread, "
          f"{len(stalls)} checkpoints), R = {r:.2f}s (measured mean restart cost), T chosen by "
          f"every_seconds auto = {t_used:.2f}s (median)")
    for what, m in ((f"the schedule's MTBF = {args.mtbf:.0f}s", args.mtbf),
                    (f"the MTBF this run saw = {seen_mtbf:.0f}s ({len(o_kills)} failures in "
                     f"{o.wall_s:.0f}s)", seen_mtbf)):
        print(f"  {what}: T_opt = {young_daly(c, m):.2f}s, predicted "
              f"{predicted_goodput(c, young_daly(c, m), m, r):.3f} (at the T chosen: "
              f"{predicted_goodput(c, t_used, m, r):.3f})   measured {o.goodput:.3f}")
    if base:
        rb = mean(base[0].restarts)
        wall = restart_from_zero_wall(args.job_seconds, args.mtbf, rb)
        print(f"  baseline, restart from zero: {RESTART_FROM_ZERO} = {wall:.0f}s for "
              f"L = {args.job_seconds:.0f}s (R = {rb:.2f}s): predicted goodput "
              f"{args.job_seconds / wall:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job-seconds", type=float, default=600, help="useful step time of the job")
    ap.add_argument("--mtbf", type=float, default=120, help="mean time between failures, s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker-share", type=float, default=0.5,
                    help="share of failures that kill the run worker rather than the trainer")
    ap.add_argument("--step-delay", type=float, default=0.2, help="seconds per training step")
    ap.add_argument("--backoff-base", type=float, default=None,
                    help="CKPT_BACKOFF_BASE_S (default: the policy's)")
    ap.add_argument("--baseline-cap", type=float, default=1800,
                    help="seconds after its first step the baseline may train (0: skip it)")
    ap.add_argument("--timeout", type=float, default=300, help="per wait, seconds")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args()
    if args.job_seconds <= 0 or args.mtbf <= 0 or args.step_delay <= 0:
        ap.error("--job-seconds, --mtbf and --step-delay must be above 0")

    horizon = max(args.baseline_cap, 20 * args.job_seconds)
    schedule = failure_schedule(args.seed, args.mtbf, horizon, args.worker_share)
    ours_cfg, plain_cfg, max_steps = configs(args)
    work = Path(tempfile.mkdtemp(prefix="bench_goodput_"))
    print(f"bench_goodput: a job of {args.job_seconds:.0f}s useful step time ({max_steps} steps "
          f"x {args.step_delay}s), failures every {args.mtbf:.0f}s on average (exponential, "
          f"seed {args.seed}), {args.worker_share:.0%} of them run-worker kills")
    print(f"  first failures (s after the first step): "
          f"{', '.join(f'{f.at_s:.0f} {f.strike}' for f in schedule[:8])}")
    print(f"  ckpt-assets: the shipped defaults and budgets, plus the one key a user sets, "
          f"checkpoint.mtbf_seconds: {args.mtbf:g} (every_seconds auto follows from it); "
          f"back-off {'the policy default' if args.backoff_base is None else args.backoff_base}"
          f"; set for measurement only: {MEASUREMENT_ONLY}; baseline: "
          f"dagster/max_retries, FROM_FAILURE, trainer from step 0, capped at "
          f"{args.baseline_cap:.0f}s")
    print(f"  host: {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; workdir {work}", flush=True)
    try:
        ours = run_ours(args, schedule, ours_cfg, max_steps, work)
        base = run_baseline(args, schedule, plain_cfg, max_steps, work) \
            if args.baseline_cap > 0 else None
        report(args, schedule, ours, base, max_steps)
    finally:
        if not args.keep:
            for _ in range(3):
                shutil.rmtree(work, ignore_errors=True)
                time.sleep(1)
    print(f"  load average at the end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
