"""Auto-resume: the failure sensors and the periodic reconciler.

`resume_failed_training` (failed runs) and `resume_terminated_training` (runs terminated
from Dagster, which end CANCELED, not FAILED) see each ended training run once and hand it
to `ckpt_assets.lifecycle.decision.consider`, which decides once and returns the resume.
`reconcile_training_runs` launches delayed (backed-off) resumes once due (it ticks on
every loop of the daemon, every 5 s: one cheap query), and every 15 s sweeps for what the
others cannot see: failures from before they were enabled or whose tick errored, and runs
stuck in STARTED whose trainer stopped heartbeating (dead) or heartbeats without completing
a step (stalled); `ckpt_assets.lifecycle.liveness` judges those and retires their trainer
before the run is marked failed.
"""

from __future__ import annotations

import time

import dagster as dg

from ckpt_assets.base.clock import iso, parse_time
from ckpt_assets.base.queries import is_training_run
from ckpt_assets.base.tags import (
    PARTITION_TAG,
    TAG_DECISION,
    TAG_DECISION_REASON,
    TAG_RESUME_AT,
    TAG_RESUMED_BY,
)
from ckpt_assets.base.view import RunView
from ckpt_assets.defs.jobs import train_job
from ckpt_assets.defs.resources import CheckpointStore
from ckpt_assets.lifecycle.decision import consider
from ckpt_assets.lifecycle.liveness import judge, read_beat, retire
from ckpt_assets.lifecycle.lost_worker import end_lost_attempt, lost_worker
from ckpt_assets.lifecycle.settings import ResumeSettings

LOOKBACK_RUNS = 200

# The daemon runs its sensor loop at most every DAEMON_LOOP_S (Dagster's floor) and skips a
# sensor whose last tick started less than its minimum interval ago. A tick starts a few
# milliseconds into its loop, so with a minimum interval equal to the loop's period the
# interval is not quite over at the next loop: each sensor ran every other loop, 10 s
# apart. TICK_S, below the period, has every sensor here evaluated on every loop: a failure
# is seen within 5 s, and a back-off is launched at the first loop after it is due. The
# reconciler's full sweep (every ended run, and the heartbeat of every STARTED run read from
# the store) runs at most every RECONCILE_EVERY_S, timed by its cursor.
DAEMON_LOOP_S = 5
TICK_S = DAEMON_LOOP_S - 1
RECONCILE_EVERY_S = 15.0


def failure_sensors_turn_s(settings: ResumeSettings) -> float:
    """How long after a run ended the failure sensors act on it. Past it the run is the
    reconciler's alone, which decides an undecided run only the whole grace after its end.

    One owner per failure at any time: Dagster launches a run_key once per sensor, not once
    across sensors, so a failure that two sensors acted on would be resumed twice. A daemon
    back from a downtime evaluates all of them at once on the failures it missed; those are
    the reconciler's. The half grace between the two turns is the longest a failure
    sensor's evaluation may take from reading the run to recording its decision."""
    return settings.launch_grace_s / 2


def _ended_s_ago(record: dg.RunRecord, now: float) -> float:
    """Seconds since the run of `record` ended (0 for one with no end time recorded yet)."""
    return now - record.end_time if record.end_time is not None else 0.0


END_EVENTS = {dg.DagsterEventType.RUN_FAILURE: dg.DagsterRunStatus.FAILURE,
              dg.DagsterEventType.RUN_CANCELED: dg.DagsterRunStatus.CANCELED}


def _end_of(instance: dg.DagsterInstance, run_id: str,
            event: dg.DagsterEvent) -> tuple[dg.DagsterRunStatus, float]:
    """How and when the run ended. Dagster stores the end event first and rewrites the run's
    record (status, end time) after it, so a sensor that sees the event may find the record
    not updated yet: the status is the event's, and the time the record's end time (what the
    reconciler's sweep reads too) or, until it is written, the event's own."""
    status = END_EVENTS[dg.DagsterEventType(event.event_type_value)]
    rec = instance.get_run_record_by_id(run_id)
    if rec is not None and rec.end_time is not None:
        return status, rec.end_time
    records = instance.get_records_for_run(
        run_id, of_type={dg.DagsterEventType.RUN_FAILURE, dg.DagsterEventType.RUN_CANCELED},
        ascending=False, limit=1).records
    return status, records[0].timestamp if records else time.time()


def _on_ended(context, store: CheckpointStore) -> dg.RunRequest | dg.SkipReason:
    settings = ResumeSettings.from_env()
    run = context.dagster_run
    status, ended = _end_of(context.instance, run.run_id, context.dagster_event)
    age = time.time() - ended
    if age >= failure_sensors_turn_s(settings):
        return dg.SkipReason(f"run {run.run_id[:8]} ended {age:.0f}s ago, past the failure "
                             "sensors' turn: the reconciler decides and resumes it")
    req = consider(context.instance, run, store, sweep=False, settings=settings,
                   ended_as=status)
    reason = context.instance.get_run_by_id(run.run_id).tags.get(TAG_DECISION_REASON)
    if req is None:  # decided against, or a back-off (the reason says), or not this run's turn
        why = reason or ("not a training run" if not is_training_run(run)
                         else "a newer run of the same training run exists")
        return dg.SkipReason(f"run {run.run_id[:8]}: {why}")
    context.log.info(f"resuming {req.partition_key}: {reason}")
    return req


@dg.run_failure_sensor(
    name="resume_failed_training",
    request_job=train_job,
    minimum_interval_seconds=TICK_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Resumes failed training runs that the failure policy deems worth it.",
)
def resume_failed_training(context: dg.RunFailureSensorContext, checkpoint_store: CheckpointStore):
    return _on_ended(context, checkpoint_store)


@dg.run_status_sensor(
    name="resume_terminated_training",
    run_status=dg.DagsterRunStatus.CANCELED,
    request_job=train_job,
    minimum_interval_seconds=TICK_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Resumes training runs terminated from Dagster (a preemption notice), unless "
                "stopped with `ckpt-assets stop`.",
)
def resume_terminated_training(context: dg.RunStatusSensorContext,
                               checkpoint_store: CheckpointStore):
    return _on_ended(context, checkpoint_store)


def fail_silent_runs(instance: dg.DagsterInstance, store: CheckpointStore,
                     settings: ResumeSettings, now: float) -> list[str]:
    """Retire the trainer of each STARTED training run judged dead (no heartbeat within the
    timeout) or stalled (heartbeating, but no step within the stall limit), and mark the run
    failed; the failure sensor, or the next sweep, resumes it by the same policy."""
    notes = []
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]),
                                 limit=LOOKBACK_RUNS):
        if not is_training_run(run):
            continue
        if lost_worker(run) is not None:  # its worker is known dead: no heartbeat to wait for
            end_lost_attempt(instance, run)
            notes.append(f"{run.run_id[:8]}: its run worker is gone; the run is failed")
            continue
        view = RunView.of(run)
        started = max(instance.get_run_record_by_id(run.run_id).start_time or now,
                      view.attempt_started_at or 0.0)
        try:
            beat = read_beat(store, run.tags[PARTITION_TAG])
        except Exception as e:  # "no beat" would declare a healthy trainer dead
            notes.append(f"{run.run_id[:8]}: not judged, its heartbeat could not be read from "
                         f"the store ({type(e).__name__}: {e})")
            continue
        verdict = judge(beat, run.run_id, started, now, settings,
                        view.attempt if view.attempt_tagged else None)
        if verdict is not None:
            notes.append(f"{run.run_id[:8]}: {retire(instance, run, store, beat, verdict, settings)}")
    return notes


def due_backoffs(instance: dg.DagsterInstance, store: CheckpointStore,
                 settings: ResumeSettings, now: float) -> list[dg.RunRequest]:
    """The resumes whose back-off has ended: one query for runs decided `resume` and not
    yet resumed, then only those with a due `ckpt/resume_at` are considered."""
    runs = instance.get_runs(filters=dg.RunsFilter(
        statuses=[dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED],
        tags={TAG_DECISION: "resume"}), limit=LOOKBACK_RUNS)
    requests = []
    for run in runs:
        due = parse_time(run.tags.get(TAG_RESUME_AT))
        if TAG_RESUMED_BY in run.tags or due is None or now < due:
            continue
        req = consider(instance, run, store, sweep=True, settings=settings)
        if req is not None:
            requests.append(req)
    return requests


@dg.sensor(
    name="reconcile_training_runs",
    job=train_job,
    minimum_interval_seconds=TICK_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Launches back-offs once due (every tick), and finds what the failure sensors "
                "missed (every 15 s): earlier failures, errored ticks, and runs whose trainer "
                "stopped heartbeating.",
)
def reconcile_training_runs(context: dg.SensorEvaluationContext,
                            checkpoint_store: CheckpointStore):
    instance, now = context.instance, time.time()
    settings = ResumeSettings.from_env()
    last = parse_time(context.cursor) if context.cursor else None
    if last is not None and 0 <= now - last < RECONCILE_EVERY_S:
        requests = due_backoffs(instance, checkpoint_store, settings, now)
        if not requests:
            return dg.SkipReason("no back-off due; the full sweep runs every "
                                 f"{RECONCILE_EVERY_S:.0f}s")
        context.log.info("; ".join(f"launching resume of {r.partition_key} (back-off ended)"
                                   for r in requests))
        return requests
    context.update_cursor(iso(now))
    return _sweep(context, instance, checkpoint_store, settings, now)


def _sweep(context, instance: dg.DagsterInstance, store: CheckpointStore,
           settings: ResumeSettings, now: float):
    requests, notes = [], fail_silent_runs(instance, store, settings, now)
    ended = instance.get_run_records(filters=dg.RunsFilter(
        statuses=[dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]), limit=LOOKBACK_RUNS)
    for rec in ended:
        run = rec.dagster_run
        if TAG_DECISION not in run.tags and _ended_s_ago(rec, now) < settings.launch_grace_s:
            continue  # within the failure sensors' turn, or the half grace after it
        req = consider(instance, run, store, sweep=True, settings=settings)
        if req is not None:
            requests.append(req)
            notes.append(f"{run.run_id[:8]}: launching resume of {req.partition_key}")
    if not requests:
        return dg.SkipReason("; ".join(notes) or "nothing to reconcile")
    context.log.info("; ".join(notes))
    return requests


SENSORS = [resume_failed_training, resume_terminated_training, reconcile_training_runs]
