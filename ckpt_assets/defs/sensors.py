"""Auto-resume: the failure sensors and the periodic reconciler.

`resume_failed_training` (failed runs) and `resume_terminated_training` (runs terminated
from Dagster, which end CANCELED, not FAILED) see each ended training run once and hand it
to `ckpt_assets.lifecycle.decision.consider`, which decides once. They launch nothing.
`reconcile_training_runs` is the one launcher of resumes: on every loop of the daemon
(every 5 s) it ends each run whose run worker is gone from this machine, decides each
failure since its last tick that no failure sensor has decided yet (they run in the same
loop: left to them, a decision was launched a loop later), and launches each decided resume
that is due, at once or once its back-off ended. Every 15 s it sweeps for what the failure
sensors cannot see (failures from before they were enabled or whose tick errored, decided
here at once, whatever their age) and for runs stuck in STARTED whose trainer stopped
heartbeating (dead) or heartbeats without completing a step (stalled);
`ckpt_assets.lifecycle.liveness` judges those and retires their trainer before the run is
marked failed. Both find ended runs by what changed since their last look
(`ckpt_assets.lifecycle.pending`, the windows and back-offs kept in the cursor), never among
the newest N runs: an old run that fails late is found, and a tick costs what changed, not
the instance's history.

One launcher, no race between sensors: Dagster launches a run_key once per sensor (not once
across sensors), so a resume requested by two sensors would be launched twice. The failure
sensors and the reconciler may both decide a run; the decision is created once in the
store, and only the reconciler turns it into a run.
"""

from __future__ import annotations

import time

import dagster as dg

from ckpt_assets.base.queries import is_training_run
from ckpt_assets.base.tags import PARTITION_TAG, TAG_PARENT_RUN_ID
from ckpt_assets.base.view import RunView
from ckpt_assets.defs.jobs import train_job
from ckpt_assets.defs.resources import CheckpointStore, MLflowResource
from ckpt_assets.lifecycle.decision import consider
from ckpt_assets.lifecycle.ended import lost_worker
from ckpt_assets.lifecycle.liveness import judge, read_beat, retire
from ckpt_assets.lifecycle.lost_worker import end_lost_attempts
from ckpt_assets.lifecycle.pending import Cursor, due_resumes, sweep_ended
from ckpt_assets.lifecycle.settings import ResumeSettings

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


END_EVENTS = {dg.DagsterEventType.RUN_FAILURE: dg.DagsterRunStatus.FAILURE,
              dg.DagsterEventType.RUN_CANCELED: dg.DagsterRunStatus.CANCELED}


def _ended_as(event: dg.DagsterEvent) -> dg.DagsterRunStatus:
    """How the run ended, from its end event: Dagster stores the event before it rewrites the
    run's record, so a sensor that sees the event may find the record not updated yet."""
    return END_EVENTS[dg.DagsterEventType(event.event_type_value)]


def _on_ended(context, store: CheckpointStore, tracking: MLflowResource) -> dg.SkipReason:
    run = context.dagster_run
    rec = consider(context.instance, run, store, ended_as=_ended_as(context.dagster_event),
                   tracking=tracking)
    if rec is None:
        why = ("not a training run" if not is_training_run(run)
               else "a newer run of the same training run exists")
        return dg.SkipReason(f"run {run.run_id[:8]}: {why}")
    if rec.resume:
        context.log.info(f"{rec.training_run}: resume decided ({rec.reason}); "
                         "reconcile_training_runs launches it")
    return dg.SkipReason(f"run {run.run_id[:8]} decided: {rec.reason}"
                         + ("; reconcile_training_runs launches the resume" if rec.resume else ""))


@dg.run_failure_sensor(
    name="resume_failed_training",
    request_job=train_job,
    minimum_interval_seconds=TICK_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Decides, once, whether each failed training run is resumed "
                "(reconcile_training_runs launches the resume).",
)
def resume_failed_training(context: dg.RunFailureSensorContext, checkpoint_store: CheckpointStore,
                           mlflow_tracking: MLflowResource):
    return _on_ended(context, checkpoint_store, mlflow_tracking)


@dg.run_status_sensor(
    name="resume_terminated_training",
    run_status=dg.DagsterRunStatus.CANCELED,
    request_job=train_job,
    minimum_interval_seconds=TICK_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Decides, once, about training runs terminated from Dagster (a preemption "
                "notice: resumed unless stopped with `ckpt-assets stop`).",
)
def resume_terminated_training(context: dg.RunStatusSensorContext,
                               checkpoint_store: CheckpointStore,
                               mlflow_tracking: MLflowResource):
    return _on_ended(context, checkpoint_store, mlflow_tracking)


def fail_silent_runs(instance: dg.DagsterInstance, store: CheckpointStore,
                     settings: ResumeSettings, now: float) -> list[str]:
    """Retire the trainer of each STARTED training run judged dead (no heartbeat within the
    timeout) or stalled (heartbeating, but no step within the stall limit), and mark the run
    failed; the reconciler's next tick (or a failure sensor) decides it by the same policy."""
    notes = []
    # Every STARTED run, however many: they are what runs now, not the instance's history.
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED])):
        # A run whose worker is known dead has no heartbeat to wait for: every tick ends it
        # (`end_lost_attempts`); one it could not end is not judged here either.
        if not is_training_run(run) or lost_worker(run) is not None:
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
        own = settings.of_run(store.open(), run.tags[PARTITION_TAG])  # its own timeouts
        verdict = judge(beat, run.run_id, started, now, own,
                        view.attempt if view.attempt_tagged else None)
        if verdict is not None:
            notes.append(f"{run.run_id[:8]}: {retire(instance, run, store, beat, verdict, own)}")
    return notes


@dg.sensor(
    name="reconcile_training_runs",
    job=train_job,
    minimum_interval_seconds=TICK_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="The one launcher of resumes: every tick, it ends each run whose run "
                "worker is gone, decides each failure since its last tick (if no failure "
                "sensor has yet) and launches each decided resume once due; every 15 s, it "
                "finds what was missed: earlier failures, errored ticks, and runs whose "
                "trainer stopped heartbeating.",
)
def reconcile_training_runs(context: dg.SensorEvaluationContext,
                            checkpoint_store: CheckpointStore, mlflow_tracking: MLflowResource):
    instance, now = context.instance, time.time()
    settings = ResumeSettings.from_env()
    cursor = Cursor.parse(context.cursor)
    ended = end_lost_attempts(instance)
    notes = [f"{r.run_id[:8]}: its run worker is gone; the run is ended" for r in ended]
    last = cursor.swept_at
    if last is not None and 0 <= now - last < RECONCILE_EVERY_S:
        found, cursor = due_resumes(instance, checkpoint_store, settings, now, cursor,
                                    mlflow_tracking)
        context.update_cursor(cursor.dump())
        notes += [f"launching resume of {r.partition_key}" for r in found.requests]
        if not found.requests:
            return dg.SkipReason("; ".join(notes) or "no resume due; the full sweep runs "
                                 f"every {RECONCILE_EVERY_S:.0f}s")
        context.log.info("; ".join(notes))
        return found.requests
    return _sweep(context, instance, checkpoint_store, settings, now, cursor, mlflow_tracking,
                  notes)


def _sweep(context, instance: dg.DagsterInstance, store: CheckpointStore,
           settings: ResumeSettings, now: float, cursor: Cursor, tracking: MLflowResource,
           notes: list[str]):
    notes += fail_silent_runs(instance, store, settings, now)
    found, cursor = sweep_ended(instance, store, settings, now, cursor, tracking)
    context.update_cursor(cursor.dump())
    notes += [f"{r.tags.get(TAG_PARENT_RUN_ID, '')[:8]}: launching resume of {r.partition_key}"
              for r in found.requests]
    if not found.requests:
        return dg.SkipReason("; ".join(notes) or "nothing to reconcile")
    context.log.info("; ".join(notes))
    return found.requests


SENSORS = [resume_failed_training, resume_terminated_training, reconcile_training_runs]
