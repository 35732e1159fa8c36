"""Auto-resume: the failure sensors and the periodic reconciler.

`resume_failed_training` (failed runs) and `resume_terminated_training` (runs terminated
from Dagster, which end CANCELED, not FAILED) see each ended training run once, read its
structured failure (exit code, failure class, last committed step; see `ckpt_assets.failures.TrainingFailure`),
apply the failure policy (`ckpt_assets.policy`) and launch at most one resume.
`reconcile_training_runs` sweeps periodically for what they cannot see: failures from
before they were enabled or whose tick errored, delayed (backed-off) resumes that are due,
and runs stuck in STARTED whose trainer stopped heartbeating.

Exactly once: a decision is written onto the failed run's tags before anything is
launched; a resume's run_key is derived from the failed run's id; only the newest run of
a partition is ever acted on (a resume, once created, is newer); and the run queue admits
one active run per partition.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict

import dagster as dg
from dagster._core.events import EngineEventData

from ckpt_assets.failures import TrainingFailure
from ckpt_assets.jobs import train_job
from ckpt_assets.metadata import to_metadata
from ckpt_assets.partitions import PARTITION_TAG, read_registration
from ckpt_assets.policy import Budget, Decision, Failure, PolicyConfig, decide
from ckpt_assets.resources import CheckpointStore
from ckpt_assets.run_state import (
    is_training_run,
    iso,
    newest_training_run,
    parse_time,
    report_state,
)
from ckpt_assets.tags import (
    TAG_ATTEMPT,
    TAG_BUDGET,
    TAG_DECIDED_AT,
    TAG_DECISION,
    TAG_DECISION_REASON,
    TAG_FAILURE_KIND,
    TAG_NEXT_BUDGET,
    TAG_NO_RESUME,
    TAG_PARENT_RUN_ID,
    TAG_RESUME_AT,
    TAG_RESUME_FROM,
    TAG_ROOT_RUN_ID,
)
from trainer.repo import CheckpointRepo

RESUME_KEY_PREFIX = "resume-"

# Reconciler: a resume the failure sensor decided and did not launch within this long was
# lost (its tick errored); heartbeats older than this mean the trainer is gone.
LAUNCH_GRACE_S = float(os.environ.get("CKPT_RECONCILE_GRACE_S", "45"))
HEARTBEAT_TIMEOUT_S = float(os.environ.get("CKPT_HEARTBEAT_TIMEOUT_S", "120"))
LOOKBACK_RUNS = 200


def policy_config() -> PolicyConfig:
    env = os.environ.get
    return PolicyConfig(
        max_preemptions=int(env("CKPT_MAX_PREEMPTIONS", "50")),
        max_transient=int(env("CKPT_MAX_TRANSIENT_FAILURES", "3")),
        crash_loop_budget=int(env("CKPT_CRASH_LOOP_BUDGET", "2")),
        backoff_base_s=float(env("CKPT_BACKOFF_BASE_S", "10")),
        backoff_max_s=float(env("CKPT_BACKOFF_MAX_S", "300")),
    )


def failure_of(instance: dg.DagsterInstance, run: dg.DagsterRun,
               store: CheckpointStore | None) -> Failure:
    """What the event log (and, for a lost worker, the store) says about how `run` ended."""
    reported: TrainingFailure | None = None
    for rec in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE):
        data = rec.dagster_event.step_failure_data
        ufd = data.user_failure_data if data else None
        if ufd:
            reported = TrainingFailure.from_metadata(
                {k: v.value for k, v in ufd.metadata.items()}) or reported
    attempt = (reported.attempt if reported else 0) or int(run.tags.get(TAG_ATTEMPT, "1") or 1)
    step = reported.last_committed_step if reported else None
    if reported is None and store is not None:
        step = committed_step(store, run.tags[PARTITION_TAG])
    return Failure(
        run_id=run.run_id, partition=run.tags[PARTITION_TAG], attempt=int(attempt),
        exit_code=reported.exit_code if reported else None,
        failure_class=reported.failure_class if reported else None,
        last_committed_step=step,
        worker_lost=reported is None and run.status == dg.DagsterRunStatus.FAILURE,
        canceled=run.status == dg.DagsterRunStatus.CANCELED,
    )


def _repo(store: CheckpointStore, partition: str) -> CheckpointRepo | None:
    s = store.open()
    reg = read_registration(s, partition)
    return CheckpointRepo(s, reg.experiment, partition) if reg else None


def committed_step(store: CheckpointStore, partition: str) -> int | None:
    try:
        repo = _repo(store, partition)
        ptr = repo.read_pointer() if repo else None
    except Exception:  # an unreadable store must not stop the decision; the step is a hint
        return None
    return ptr.step if ptr and ptr.checkpoint else None


def budget_of(run: dg.DagsterRun, tag: str = TAG_BUDGET) -> Budget:
    return Budget.from_tag(run.tags.get(tag, ""))


def record(instance: dg.DagsterInstance, run: dg.DagsterRun, failure: Failure,
           decision: Decision) -> None:
    """Write the decision where the reconciler and people look: the failed run's tags (what
    the sensors act on), its own log in words, and the partition's new state."""
    # Rounded down: a decision time in the future would look not yet due.
    decided = math.floor(time.time() * 1000) / 1000
    tags = {TAG_DECISION: "resume" if decision.resume else "stop",
            TAG_DECISION_REASON: decision.reason[:400], TAG_FAILURE_KIND: decision.kind,
            TAG_DECIDED_AT: iso(decided), TAG_NEXT_BUDGET: decision.budget.to_tag(),
            **({TAG_RESUME_AT: iso(decided + decision.delay_s)}
               if decision.resume and decision.delay_s > 0 else {})}
    instance.add_run_tags(run.run_id, tags)
    run_key = f"{RESUME_KEY_PREFIX}{run.run_id}"
    facts = to_metadata({
        "failed_run_id": run.run_id, "decision": tags[TAG_DECISION], "reason": decision.reason,
        "failure_kind": decision.kind, "exit_code": failure.exit_code,
        "failure_class": failure.failure_class,
        "last_committed_step": failure.last_committed_step, "attempt": failure.attempt,
        "delay_s": float(decision.delay_s), "budget": asdict(decision.budget),
        "resume_run_key": run_key if decision.resume else None})
    # In words, in the failed run's own log, where whoever opens that run looks first. The
    # resume's run id does not exist yet (the daemon assigns it at launch): the resume links
    # back to this run, and tags it `ckpt/resumed_by`, once it starts.
    if not decision.resume:
        words = f"Not resumed ({decision.kind}): {decision.reason.removeprefix('not resumed: ')}"
    elif decision.delay_s > 0:
        words = (f"Will be resumed after a back-off of {decision.delay_s:.0f}s "
                 f"({decision.kind}): {decision.reason}. The resume's run key is {run_key}.")
    else:
        words = (f"Resuming now ({decision.kind}): {decision.reason}. The resume's run key is "
                 f"{run_key}; it records its run id on this run when it starts.")
    try:
        instance.report_engine_event(words, dagster_run=run,
                                     engine_event_data=EngineEventData(metadata=facts))
    except Exception:  # the tags above are the record the sensors act on; this is for people
        logging.getLogger(__name__).warning("could not log the resume decision on run %s",
                                            run.run_id, exc_info=True)
    report_state(instance, failure.partition, facts)


def resume_request(run: dg.DagsterRun, failure: Failure,
                   store: CheckpointStore | None) -> dg.RunRequest:
    resume_from = ""
    if store is not None and failure.last_committed_step is not None:
        try:
            repo = _repo(store, failure.partition)
            ptr = repo.read_pointer() if repo else None
            resume_from = repo.uri(ptr.checkpoint) if ptr and ptr.checkpoint else ""
        except Exception:
            resume_from = ""
    return dg.RunRequest(
        run_key=f"{RESUME_KEY_PREFIX}{run.run_id}",
        partition_key=failure.partition,
        job_name=train_job.name,
        tags={TAG_PARENT_RUN_ID: run.run_id,
              TAG_ROOT_RUN_ID: run.tags.get(TAG_ROOT_RUN_ID, run.run_id),
              TAG_ATTEMPT: str(failure.attempt + 1),
              TAG_RESUME_FROM: resume_from or "latest",
              TAG_BUDGET: run.tags.get(TAG_NEXT_BUDGET, "")},
    )


def consider(instance: dg.DagsterInstance, run: dg.DagsterRun, store: CheckpointStore | None,
             sweep: bool) -> dg.RunRequest | None:
    """Decide about one ended training run (once) and return its resume if it is due now.

    The failure sensors (sweep=False) launch immediate resumes; the reconciler (sweep=True)
    launches backed-off ones when due, and immediate ones the sensors did not launch in time.
    """
    if not is_training_run(run):
        return None
    newest = newest_training_run(instance, run.tags[PARTITION_TAG])
    if newest is None or newest.run_id != run.run_id:
        return None  # a newer run of this partition exists (e.g. the resume): moot
    if TAG_DECISION not in run.tags:
        failure = failure_of(instance, run, store)
        if run.tags.get(TAG_NO_RESUME) == "true":
            decision = Decision(False, "stopped_by_user", "not resumed: stopped on request")
        else:
            decision = decide(failure, budget_of(run), policy_config())
        record(instance, run, failure, decision)
        run = instance.get_run_by_id(run.run_id)
    if run.tags.get(TAG_DECISION) != "resume":
        return None
    decided_at = parse_time(run.tags.get(TAG_DECIDED_AT)) or 0.0
    resume_at = parse_time(run.tags.get(TAG_RESUME_AT))
    now = time.time()
    # The failure sensors launch an immediate resume without looking at the clock at all.
    if resume_at is not None:
        if not sweep or now < resume_at:
            return None  # a back-off: the reconciler launches it once due
    elif sweep and now < decided_at + LAUNCH_GRACE_S:
        return None  # the failure sensor's launch may still be on its way
    return resume_request(run, failure_of(instance, run, store), store)


def _on_ended(context, store: CheckpointStore) -> dg.RunRequest | dg.SkipReason:
    run = context.dagster_run
    req = consider(context.instance, run, store, sweep=False)
    reason = context.instance.get_run_by_id(run.run_id).tags.get(TAG_DECISION_REASON)
    if req is None:
        return dg.SkipReason(f"run {run.run_id[:8]}: {reason or 'not a training run'}")
    context.log.info(f"resuming {req.partition_key}: {reason}")
    return req


@dg.run_failure_sensor(
    name="resume_failed_training",
    request_job=train_job,
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Resumes failed training runs that the failure policy deems worth it.",
)
def resume_failed_training(context: dg.RunFailureSensorContext, checkpoint_store: CheckpointStore):
    return _on_ended(context, checkpoint_store)


@dg.run_status_sensor(
    name="resume_terminated_training",
    run_status=dg.DagsterRunStatus.CANCELED,
    request_job=train_job,
    minimum_interval_seconds=5,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Resumes training runs terminated from Dagster (a preemption notice), unless "
                "stopped with `ckpt-assets stop`.",
)
def resume_terminated_training(context: dg.RunStatusSensorContext,
                               checkpoint_store: CheckpointStore):
    return _on_ended(context, checkpoint_store)


def heartbeat_age(store: CheckpointStore, partition: str) -> float | None:
    try:
        repo = _repo(store, partition)
        beat = repo.read_heartbeat() if repo else None
    except Exception:
        return None
    return time.time() - float(beat["time"]) if beat and "time" in beat else None


@dg.sensor(
    name="reconcile_training_runs",
    job=train_job,
    minimum_interval_seconds=15,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Finds what the failure sensors missed: earlier failures, errored ticks, due "
                "back-offs, and runs whose trainer stopped heartbeating.",
)
def reconcile_training_runs(context: dg.SensorEvaluationContext,
                            checkpoint_store: CheckpointStore):
    instance = context.instance
    now = time.time()
    requests, notes = [], []
    # Runs stuck in STARTED whose trainer is gone: mark them failed; the next sweep (or the
    # failure sensor) resumes them by the same policy.
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]),
                                 limit=LOOKBACK_RUNS):
        if not is_training_run(run):
            continue
        started = instance.get_run_record_by_id(run.run_id).start_time or now
        age = heartbeat_age(checkpoint_store, run.tags[PARTITION_TAG])
        if now - started > HEARTBEAT_TIMEOUT_S and (age is None or age > HEARTBEAT_TIMEOUT_S):
            msg = (f"trainer heartbeat lost ({'none' if age is None else f'{age:.0f}s old'}, "
                   f"timeout {HEARTBEAT_TIMEOUT_S:.0f}s): marking the run failed")
            instance.report_run_failed(run, msg)
            notes.append(f"{run.run_id[:8]}: {msg}")
    ended = instance.get_runs(filters=dg.RunsFilter(
        statuses=[dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED]), limit=LOOKBACK_RUNS)
    for run in ended:
        if TAG_DECISION not in run.tags:
            end = instance.get_run_record_by_id(run.run_id).end_time or now
            if now - end < LAUNCH_GRACE_S:
                continue  # the failure sensors have not had their turn yet
        req = consider(instance, run, checkpoint_store, sweep=True)
        if req is not None:
            requests.append(req)
            notes.append(f"{run.run_id[:8]}: launching resume of {req.partition_key}")
    if not requests:
        return dg.SkipReason("; ".join(notes) or "nothing to reconcile")
    context.log.info("; ".join(notes))
    return requests


SENSORS = [resume_failed_training, resume_terminated_training, reconcile_training_runs]
