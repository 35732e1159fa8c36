"""Time from a SIGKILL of the trainer to the resumed trainer's first completed step.

A real dagster-daemon (tests.daemon_harness.Daemon, on a temporary DAGSTER_HOME made from
the project's dagster_home/dagster.yaml) runs one long training run; the benchmark kills
its trainer process with SIGKILL N times, each time a random (seeded) number of steps after
the current attempt's first completed step, and waits for the failure sensor to resume it
(that daemon runs with CKPT_IN_RUN_RELAUNCH=0: the sensor path). `--strike worker` kills the
run worker instead (the process that runs the step; its trainer commits and exits 143, and
the run's code server fails the run): always the sensor path.
Then, on a second daemon with CKPT_IN_RUN_RELAUNCH=1 (the default), it kills the trainer of another run
(its run worker alive) `--in-run-kills` times: the step relaunches it in the same Dagster
run (`ckpt_assets.attempt.in_run`), and the two paths' kill -> first resumed step are printed side
by side.
For each kill it splits kill -> first resumed step into

  detection  kill -> the failed Dagster run's end       (run record end_time)
  sensor     failed run's end -> resume run created     (run record create_timestamp)
  queue      resume run created -> resume run started   (run record start_time: dequeue,
                                                          run worker spawn, RUN_START)
  restore    resume run started -> first completed step  (first heartbeat of the new attempt,
                                                          its own `time`; polled every 20 ms)

and the work lost per interruption, in steps.

The policy is the shipped one: each kill comes after a new checkpoint, so it resumes at
once and spends no budget (budgets count failures without progress).

    python benchmarks/bench_resume_latency.py [--kills 10] [--in-run-kills 5] [--seed 0]
        [--step-delay 0.15]
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt_assets.attempt.process import PROCESS_STARTED, WARM_STARTED  # noqa: E402
from ckpt_assets.base.attempt_processes import AttemptProcesses  # noqa: E402
from ckpt_assets.base.clock import parse_time  # noqa: E402
from ckpt_assets.base.events import STATE, partition_events  # noqa: E402
from ckpt_assets.base.tags import TAG_ATTEMPT, TAG_PARENT_RUN_ID, TAG_RESUME_FROM  # noqa: E402
from ckpt_assets.defs.sensors import DAEMON_LOOP_S, RECONCILE_EVERY_S  # noqa: E402
from ckpt_assets.lifecycle.policy import PolicyConfig  # noqa: E402
from ckpt_assets.lifecycle.settings import Setting  # noqa: E402
from tests.daemon_harness import PROJECT_WORKSPACE, Daemon, training_config  # noqa: E402
from tests.polling import WaitTimeout, pid_alive, wait_for  # noqa: E402
from trainer.checkpoints.manifest import parse_checkpoint_name  # noqa: E402
from trainer.checkpoints.repo import CheckpointRepo  # noqa: E402
from trainer.storage import open_store  # noqa: E402

RUN = "bench-resume"
RUN_IN = "bench-resume-in-run"
SENSOR_INTERVAL_S = DAEMON_LOOP_S  # how often the daemon evaluates resume_failed_training
RECONCILE_INTERVAL_S = RECONCILE_EVERY_S  # reconcile_training_runs: its full sweep
POLL_S = 0.02
IN_RUN_TARGET_S = 1.5  # a killed trainer's relaunch in its run, warm: kill -> first resumed step
TRAINER, WORKER = "trainer", "worker"  # what --strike kills


class BenchError(RuntimeError):
    pass


def poll(pred, what: str, timeout: float, every: float = POLL_S):
    try:
        return wait_for(pred, timeout, every, what)
    except WaitTimeout as e:
        raise BenchError(str(e)) from None



@dataclass(frozen=True)
class Kill:
    at: float  # time.time() of the SIGKILL
    pre_step: int  # the heartbeat's step that triggered it
    ptr_step: int  # the pointer's step once the trainer was gone
    step: int  # the last step the trainer completed


def kill_at_step(daemon, run: str, repo, attempt: int, target: int, timeout: float,
                 strike: str = TRAINER) -> Kill:
    """SIGKILL `run`'s trainer (or, `strike` WORKER, its run worker: the trainer then commits
    and exits on its own) once `attempt` reached step `target`."""
    def reached():
        hb = daemon.heartbeat(run)
        return hb if hb and int(hb["attempt"]) == attempt and int(hb["step"]) >= target else None

    pre = poll(reached, f"attempt {attempt} to reach step {target}", timeout)
    pid = int(pre["pid"])
    victim = pid
    if strike == WORKER:
        procs = AttemptProcesses.of_run(daemon.runs(run)[-1])
        if procs is None:
            raise BenchError(f"the run of attempt {attempt} records no processes")
        victim = procs.worker.pid
    t_kill = time.time()
    os.kill(victim, signal.SIGKILL)
    poll(lambda: not pid_alive(pid), f"trainer pid {pid} to end", 60)
    # The trainer is dead now: its last heartbeat and the pointer are final for this attempt.
    post = daemon.heartbeat(run)
    post_step = int(post["step"]) if post and int(post["attempt"]) == attempt else int(pre["step"])
    ptr = repo.read_pointer()
    ptr_step = ptr.step if ptr and ptr.checkpoint else 0
    # A kill between a checkpoint's commit and that step's heartbeat: the pointer is newer.
    return Kill(t_kill, int(pre["step"]), ptr_step, max(post_step, ptr_step))

def ts(dt) -> float:
    return dt.timestamp() if hasattr(dt, "timestamp") else float(dt)


TRAINER_TIME_RE = re.compile(r"^\[trainer\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


RESTORE_RE = re.compile(r"\(restore ([0-9.]+)s\)")


def trainer_time(line: str) -> float | None:
    """Epoch seconds of a trainer log line's own (local time) timestamp."""
    m = TRAINER_TIME_RE.match(line)
    if not m:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000


def phases(daemon: Daemon, run_id: str) -> dict[str, float]:
    """Event-log timestamps of a resume run's start-up milestones (absent ones are missing)."""
    out: dict[str, float] = {}
    # This Dagster writes no RUN_DEQUEUED for the default coordinator: RUN_STARTING (the
    # launcher was called) marks the dequeue.
    marks = {"RUN_DEQUEUED": "dequeued", "RUN_STARTING": "dequeued", "RUN_START": "start"}
    for e in daemon.instance.all_logs(run_id):
        ev = e.dagster_event
        if ev is not None:
            if ev.event_type.name in marks:
                out.setdefault(marks[ev.event_type.name], e.timestamp)
            continue
        msg = e.user_message or ""
        if msg.startswith(PROCESS_STARTED):
            out.setdefault("spawned", e.timestamp)
        elif msg.startswith("[trainer]") and (" resumed from " in msg or " from scratch " in msg):
            # Logged once restored, before step 1. The event is written when the run worker
            # reads the line; the line's own timestamp is the trainer's.
            out.setdefault("restored", trainer_time(msg) or e.timestamp)
            m = RESTORE_RE.search(msg)
            if m:
                out.setdefault("ckpt_load", float(m.group(1)))
    return out


def first_beat_of_new_attempt(daemon: Daemon, old_attempt: int, timeout: float,
                              run: str = RUN) -> dict:
    def got():
        hb = daemon.heartbeat(run)
        # Beats start at restore: the first completed step is the first past the resumed one.
        return hb if hb and int(hb.get("attempt", 0)) > old_attempt and \
            int(hb["step"]) > int(hb.get("resumed_step", -1)) else None
    return poll(got, f"a heartbeat of an attempt after {old_attempt}", timeout)


def measure_one(daemon: Daemon, repo: CheckpointRepo, rng: random.Random, first_hb: dict,
                every_steps: int, timeout: float, strike: str) -> tuple[dict, dict]:
    """Kill the attempt whose first heartbeat is `first_hb`; return (row, next first_hb)."""
    attempt = int(first_hb["attempt"])
    runs = daemon.runs(RUN)
    failed = runs[-1]
    if failed.status.value != "STARTED":
        raise BenchError(f"newest run {failed.run_id[:8]} is {failed.status.value}, not STARTED")
    target = int(first_hb["step"]) + rng.randint(2, every_steps + 1)
    kill = kill_at_step(daemon, RUN, repo, attempt, target, timeout, strike)
    t_kill, step_at_kill = kill.at, kill.step

    def ended():
        rec = daemon.instance.get_run_record_by_id(failed.run_id)
        return rec if rec.end_time is not None else None

    failed_rec = poll(ended, f"run {failed.run_id[:8]} to end", timeout, every=0.05)

    def resumed():
        for r in daemon.instance.get_runs(limit=20):
            if r.tags.get(TAG_PARENT_RUN_ID) == failed.run_id:
                return r
        return None

    resume = poll(resumed, f"a resume of run {failed.run_id[:8]}", timeout, every=0.05)

    def started():
        rec = daemon.instance.get_run_record_by_id(resume.run_id)
        return rec if rec.start_time is not None else None

    resume_rec = poll(started, f"resume run {resume.run_id[:8]} to start", timeout, every=0.05)
    nxt = first_beat_of_new_attempt(daemon, attempt, timeout)
    failed_run = daemon.instance.get_run_by_id(failed.run_id)

    name = resume.tags.get(TAG_RESUME_FROM, "").rstrip("/").rsplit("/", 1)[-1]
    parsed = parse_checkpoint_name(name)
    resumed_from = parsed[0] if parsed else 0  # "latest" only before any checkpoint: step 0
    if int(nxt["step"]) - 1 != resumed_from:
        raise BenchError(f"attempt {nxt['attempt']} first completed step {nxt['step']}, but "
                         f"its resume_from tag names step {resumed_from} ({name!r})")
    if int(resume.tags.get(TAG_ATTEMPT, "0")) != int(nxt["attempt"]):
        raise BenchError(f"resume run says attempt {resume.tags.get(TAG_ATTEMPT)}, "
                         f"heartbeat says {nxt['attempt']}")

    t_end = float(failed_rec.end_time)
    t_created = ts(resume_rec.create_timestamp)
    t_start = float(resume_rec.start_time)
    t_first = float(nxt["time"])
    row = {
        "attempt": attempt, "pre_step": kill.pre_step, "step_at_kill": step_at_kill,
        "ptr_step": kill.ptr_step, "resumed_from": resumed_from, "lost": step_at_kill - resumed_from,
        "detect": t_end - t_kill, "sensor": t_created - t_end, "queue": t_start - t_created,
        "launch": t_start - t_end, "restore": t_first - t_start, "total": t_first - t_kill,
        "kind": failed_run.tags.get("ckpt/failure_kind", "?"),
        "by": resume.tags.get("dagster/sensor_name", "?"),
        "_resume_run_id": resume.run_id, "_t_created": t_created, "_t_start": t_start,
        "_t_first": t_first, "_t_end": t_end,
        "_decided": parse_time(failed_run.tags.get("ckpt/decided_at")) or float("nan"),
    }
    return row, nxt


def add_detail(daemon: Daemon, r: dict) -> None:
    """Split sensor/queue/restore further, from the decision tag and the resume run's event
    log (read after the last kill, so that reading it never delays a kill)."""
    ph = phases(daemon, r["_resume_run_id"])
    nan = float("nan")

    def gap(a: str, b: str) -> float:
        return ph[b] - ph[a] if a in ph and b in ph else nan

    r.update({
        "decide": r["_decided"] - r["_t_end"],  # the sensor's tick picks the failed run up
        "request": r["_t_created"] - r["_decided"],  # decision -> resume run created
        "dequeue": ph.get("dequeued", nan) - r["_t_created"],
        "spawn_worker": gap("dequeued", "start"),  # launcher spawns the run worker; RUN_START
        "asset_setup": ph.get("spawned", nan) - r["_t_start"],  # -> trainer process spawned
        "trainer_load": gap("spawned", "restored"),  # interpreter, imports, checkpoint load
        "ckpt_load": ph.get("ckpt_load", 0.0),  # of which the checkpoint load (0: from scratch)
        "first_step": r["_t_first"] - ph.get("restored", nan),
    })


def relaunch_noted(daemon: Daemon, run_id: str, attempt: int) -> float | None:
    """When the step said it relaunches `attempt` in run `run_id` (its state observation)."""
    for md, rec in partition_events(daemon.instance, RUN_IN, STATE, newest_first=True,
                                    limit=20):
        if md.get("relaunched_in_run") and md.get("attempt") == attempt + 1 \
                and rec.run_id == run_id:
            return rec.timestamp
    return None


def measure_in_run(daemon: Daemon, repo: CheckpointRepo, rng: random.Random, first_hb: dict,
                   every_steps: int, timeout: float) -> tuple[dict, dict]:
    """Kill the trainer of the attempt whose first heartbeat is `first_hb`, its run worker
    alive; the step relaunches it in the same Dagster run. Return (row, next first_hb)."""
    attempt = int(first_hb["attempt"])
    (run,) = [r for r in daemon.runs(RUN_IN) if r.status.value == "STARTED"]
    target = int(first_hb["step"]) + rng.randint(2, every_steps + 1)
    kill = kill_at_step(daemon, RUN_IN, repo, attempt, target, timeout)
    t_kill, step_at_kill = kill.at, kill.step
    nxt = first_beat_of_new_attempt(daemon, attempt, timeout, RUN_IN)
    runs = daemon.runs(RUN_IN)
    if [r.run_id for r in runs] != [run.run_id] or runs[0].status.value != "STARTED":
        raise BenchError(f"expected the one Dagster run {run.run_id[:8]} to carry on, found "
                         f"{[(r.run_id[:8], r.status.value) for r in runs]}")
    resumed_from = int(nxt["step"]) - 1
    noted = relaunch_noted(daemon, run.run_id, attempt)
    t_first = float(nxt["time"])
    nan = float("nan")
    started = [r.user_message for r in daemon.instance.all_logs(run.run_id)
               if (r.user_message or "").startswith(PROCESS_STARTED)]
    row = {"attempt": attempt, "step_at_kill": step_at_kill, "resumed_from": resumed_from,
           "lost": step_at_kill - resumed_from,
           "warm": len(started) > attempt and WARM_STARTED in started[attempt],
           "decide": (noted - t_kill) if noted else nan,
           "restart": (t_first - noted) if noted else nan, "total": t_first - t_kill}
    return row, nxt


def in_run_path(args, rng: random.Random, env: dict, cfg: dict, warm: bool) -> list[dict]:
    """The same kills, with the daemon's run workers relaunching in-run
    (CKPT_IN_RUN_RELAUNCH=1): kill -> the step's relaunch decision -> first resumed step.
    `warm`: with the standby trainer (the default), else CKPT_WARM_TRAINER=0."""
    work = Path(tempfile.mkdtemp(prefix="bench_resume_in_run_"))
    store = str(work / "store")
    daemon, rows = None, []
    try:
        daemon = Daemon.start(work, store, extra_env={
            **env, Setting.IN_RUN_RELAUNCH.value: "1",
            Setting.WARM_TRAINER.value: "1" if warm else "0"}, workspace=PROJECT_WORKSPACE)
        daemon.launch(RUN_IN, {**cfg, "run": RUN_IN}, work)
        repo = CheckpointRepo(open_store(store), "default", RUN_IN)
        hb = first_beat_of_new_attempt(daemon, 0, args.timeout, RUN_IN)
        print(f"\nin-run path, {'warm' if warm else 'cold'} trainer: {args.in_run_kills} "
              "SIGKILLs of the trainer, its run worker alive, CKPT_IN_RUN_RELAUNCH=1, "
              f"CKPT_WARM_TRAINER={int(warm)} (same policy settings)")
        print(f"{'kill':>4} {'att':>4} {'kill':>7} {'from':>7} {'lost':>5}  {'decide':>7} "
              f"{'restart':>8} {'total':>7}  (seconds; decide: kill -> the step's relaunch "
              "state observation; restart: -> first resumed step)")
        for i in range(1, args.in_run_kills + 1):
            row, hb = measure_in_run(daemon, repo, rng, hb, args.every_steps, args.timeout)
            rows.append(row)
            print(f"{i:>4} {row['attempt']:>4} {row['step_at_kill']:>7} {row['resumed_from']:>7} "
                  f"{row['lost']:>5}  {row['decide']:>7.2f} {row['restart']:>8.2f} "
                  f"{row['total']:>7.2f}", flush=True)
        print(f"  Dagster runs of the partition: {len(daemon.runs(RUN_IN))} (all attempts in one)")
        daemon.cli("stop", RUN_IN)
    except BaseException:
        if daemon is not None:
            print("\n--- daemon log tail ---\n" + daemon.log_tail(60), file=sys.stderr)
        raise
    finally:
        if daemon is not None:
            daemon.stop()
        if not args.keep:
            for _ in range(3):
                shutil.rmtree(work, ignore_errors=True)
                time.sleep(1)
    return rows


def fmt_row(i: int, r: dict) -> str:
    return (f"{i:>4} {r['attempt']:>4} {r['step_at_kill']:>7} {r['resumed_from']:>7} "
            f"{r['lost']:>5}  {r['detect']:>7.2f} {r['sensor']:>7.2f} {r['queue']:>7.2f} "
            f"{r['launch']:>7.2f} {r['restore']:>8.2f} {r['total']:>7.2f}  {r['kind']:<7} {r['by']}")


DETAIL = ("decide", "request", "dequeue", "spawn_worker", "asset_setup", "trainer_load",
          "ckpt_load", "first_step")


def fmt_detail(i: int, r: dict) -> str:
    return f"{i:>4} " + " ".join(f"{r[k]:>{max(7, len(k))}.2f}" for k in DETAIL)


def sensor_path(args, rng: random.Random, env: dict, cfg: dict, work: Path) -> list[dict]:
    """The sensor path: a killed trainer's run fails and a sensor launches the resume as a
    new Dagster run (CKPT_IN_RUN_RELAUNCH=0). Prints each kill and the summary."""
    store = str(work / "store")

    daemon = None
    rows: list[dict] = []
    t0 = time.monotonic()
    try:
        # The sensor path: a killed trainer's run fails and a sensor launches the resume.
        daemon = Daemon.start(work, store, extra_env={**env, Setting.IN_RUN_RELAUNCH.value: "0"},
                              workspace=PROJECT_WORKSPACE)
        daemon.launch(RUN, cfg, work)
        repo = CheckpointRepo(open_store(store), "default", RUN)
        hb = first_beat_of_new_attempt(daemon, 0, args.timeout)
        print(f"  first attempt up: attempt {hb['attempt']}, step {hb['step']} "
              f"({time.monotonic() - t0:.1f}s after launch)\n")
        print(f"{'':>4} {'':>4} {'step at':>7} {'resumed':>7} {'':>5}  {' seconds ':-^57}")
        print(f"{'kill':>4} {'att':>4} {'kill':>7} {'from':>7} {'lost':>5}  {'detect':>7} "
              f"{'sensor':>7} {'queue':>7} {'launch':>7} {'restore':>8} {'total':>7}  "
              f"{'kind':<7} resumed by")
        for i in range(1, args.kills + 1):
            row, hb = measure_one(daemon, repo, rng, hb, args.every_steps, args.timeout,
                                  args.strike)
            rows.append(row)
            print(fmt_row(i, row), flush=True)
        max_active = daemon.max_active.get(RUN, 0)
        time.sleep(2)  # the last resume's trainer log lines reach its event log
        for row in rows:
            add_detail(daemon, row)
        print("\nwhere the time goes (seconds; from run tags and the resume run's event log):")
        print("  decide: failed run end -> sensor's decision (ckpt/decided_at); request: "
              "-> resume run created;")
        print("  dequeue: -> RUN_STARTING (dequeued, launcher called); spawn_worker: -> "
              "RUN_START (the run worker process is up and has loaded the code);")
        print("  asset_setup: RUN_START -> trainer process spawned; trainer_load: -> trainer "
              "logged 'resumed from'/'from scratch' (interpreter, imports, restore);")
        print("  ckpt_load: of trainer_load, the checkpoint restore as the trainer timed it "
              "(0 = from scratch); first_step: -> first heartbeat of the new attempt")
        print("kill " + " ".join(f"{k:>{max(7, len(k))}}" for k in DETAIL))
        for i, row in enumerate(rows, 1):
            print(fmt_detail(i, row))
        # Let the last attempt go: stop it without a resume (SIGTERM, final checkpoint).
        res = daemon.cli("stop", RUN)
        if res.returncode == 0:
            try:
                poll(lambda: daemon.runs(RUN)[-1].status.value in ("CANCELED", "FAILURE",
                                                                     "SUCCESS"),
                     "the last attempt to stop", 60, every=0.5)
            except BenchError as e:
                print(f"  ({e}; the daemon's shutdown kills it)")
        else:
            print(f"  (ckpt-assets stop: {res.stdout.strip()} {res.stderr.strip()})")
    except BaseException:
        if daemon is not None:
            print("\n--- daemon log tail ---\n" + daemon.log_tail(60), file=sys.stderr)
        raise
    finally:
        if daemon is not None:
            daemon.stop()
        if not args.keep:
            # A run worker still writing its last events can re-create the instance's SQLite
            # files just after a first removal.
            for _ in range(3):
                shutil.rmtree(work, ignore_errors=True)
                time.sleep(1)
            shutil.rmtree(work, ignore_errors=True)

    def stat(key: str) -> str:
        vals = [r[key] for r in rows]
        return f"median {statistics.median(vals):6.2f}s  worst {max(vals):6.2f}s"

    totals = [r["total"] for r in rows]
    lost = [r["lost"] for r in rows]
    # A killed run worker's run: ours to resume at the sensor's next loop, and then a new run
    # worker and trainer to start (issue target); a killed trainer's run, the older target.
    target_s = SENSOR_INTERVAL_S + (4 if args.strike == WORKER else 15)
    med = statistics.median(totals)
    ok_t = med <= target_s
    ok_l = max(lost) <= args.every_steps
    print(f"\nsummary over {len(rows)} kills (wall {time.monotonic() - t0:.0f}s, sensor interval "
          f"{SENSOR_INTERVAL_S}s, shipped policy; load average now "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs):")
    print(f"  detection  kill -> failed run end          {stat('detect')}")
    print(f"  launch     failed run end -> resume start  {stat('launch')}")
    print(f"    sensor   failed run end -> resume queued {stat('sensor')}")
    print(f"    queue    resume queued -> resume start   {stat('queue')}")
    print(f"  restore    resume start -> 1st new step    {stat('restore')}")
    print(f"  total      kill -> 1st resumed step        {stat('total')}")
    print("  sub-phases:")
    for k in DETAIL:
        if all(r[k] == r[k] for r in rows):  # no NaN
            print(f"    {k:<13}{'':28}{stat(k)}")
    print(f"  lost work  median {statistics.median(lost):.1f} steps, worst {max(lost)} steps "
          f"(checkpoint every {args.every_steps}); per kill: {lost}")
    behind = [r["step_at_kill"] - r["pre_step"] for r in rows]
    print(f"  step at kill vs the heartbeat read just before the kill: +{max(behind)} at most "
          f"({sum(1 for x in behind if x)} of {len(rows)} kills differ)")
    print(f"  resumed by: {sorted({r['by'] for r in rows})}; failure kinds: "
          f"{sorted({r['kind'] for r in rows})}; max active runs of the partition: {max_active}")
    print(f"target: median kill of the {args.strike} -> first resumed step <= sensor interval + "
          f"{target_s - SENSOR_INTERVAL_S}s = {target_s}s: "
          f"{'MET' if ok_t else 'MISSED'} ({med:.2f}s)")
    print(f"target: lost work <= one checkpoint interval = {args.every_steps} steps: "
          f"{'MET' if ok_l else 'MISSED'} (worst {max(lost)})")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--in-run-kills", type=int, default=5,
                    help="kills of the trainer with its run worker alive, relaunched in-run "
                         "(0: skip that path)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strike", choices=(TRAINER, WORKER), default=TRAINER,
                    help="what the sensor path's SIGKILLs strike: the trainer, or its run "
                         "worker (the process running the step)")
    ap.add_argument("--step-delay", type=float, default=0.15, help="seconds per training step")
    ap.add_argument("--every-steps", type=int, default=10, help="checkpoint.every_steps")
    ap.add_argument("--timeout", type=float, default=180, help="per wait, seconds")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args()
    if args.kills < 0:
        ap.error("--kills must be 0 (skip the sensor path) or more")

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="bench_resume_"))
    kills = max(args.kills, args.in_run_kills)  # of one run
    # The shipped policy: every kill comes after a new checkpoint, so the budgets (spent only
    # by failures without progress) and the back-off (none after progress) never act. Only
    # the test harness's short back-off is put back to the policy's own.
    env = {"CKPT_BACKOFF_BASE_S": str(PolicyConfig().backoff_base_s)}
    # Long enough to outlast every kill: ~every_steps+a few steps per attempt, plus margin.
    max_steps = 100 + kills * (args.every_steps + 20) * 2
    cfg = training_config(RUN, max_steps=max_steps, eval_every=0,
                          checkpoint={"every_steps": args.every_steps, "heartbeat_seconds": 0,
                                      "on_epoch_end": False, "on_best": False},
                          task_args={"step_delay": args.step_delay})

    print(f"bench_resume_latency: {args.kills} SIGKILLs of the {args.strike}, seed {args.seed}")
    print(f"  sensor: resume_failed_training every {SENSOR_INTERVAL_S}s (reconciler every "
          f"{RECONCILE_INTERVAL_S}s, grace 20s); run queue dequeues every 1s")
    print(f"  training: max_steps {max_steps}, step_delay {args.step_delay}s, checkpoint every "
          f"{args.every_steps} steps only (sync; no epoch-end/best saves), heartbeat every "
          "step")
    print("  policy: " + ", ".join(f"{k}={v}" for k, v in env.items())
          + "  (the shipped defaults: a kill after progress resumes at once)")
    print(f"  kill: SIGKILL of the {args.strike} pid, 2..{args.every_steps + 1} steps (seeded) after "
          "the attempt's first completed step")
    print("  lost work = step at kill - step resumed from; step at kill = max(last heartbeat "
          "after the trainer is dead, committed pointer step); resumed from = the resume run's "
          "ckpt/resume_from checkpoint (checked: = first heartbeat step of the new attempt - 1)")
    print(f"  host: {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (process start-up dominates: "
          "compare hosts with care)")
    print(f"  workdir: {work}", flush=True)
    rows = sensor_path(args, rng, env, cfg, work) if args.kills else []
    if args.in_run_kills < 1:
        return 0
    warm = in_run_path(args, rng, env, cfg, warm=True)
    cold = in_run_path(args, rng, env, cfg, warm=False)

    def both(key: str, rows_: list[dict]) -> str:
        vals = [r[key] for r in rows_]
        return f"median {statistics.median(vals):6.2f}s  worst {max(vals):6.2f}s"

    print("\nkill of the trainer -> first resumed step, side by side:")
    if rows:
        print(f"  sensor path (new Dagster run)        {len(rows):>3} kills  {both('total', rows)}")
    for name, in_run in (("warm", warm), ("cold", cold)):
        print(f"  in-run path, {name} trainer (same run) {len(in_run):>3} kills  "
              f"{both('total', in_run)}")
        print(f"    decide {both('decide', in_run)}; restart {both('restart', in_run)}; "
              f"lost work per kill {[r['lost'] for r in in_run]}; started by a standby: "
              f"{sum(r['warm'] for r in in_run)} of {len(in_run)}")
    med = statistics.median(r["total"] for r in warm)
    print(f"target: median kill of the trainer -> first resumed step <= {IN_RUN_TARGET_S}s "
          f"(in-run, warm, {len(warm)} kills): "
          f"{'MET' if med <= IN_RUN_TARGET_S else 'MISSED'} ({med:.2f}s; cold/warm restart ratio "
          f"{statistics.median(r['restart'] for r in cold) / statistics.median(r['restart'] for r in warm):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
