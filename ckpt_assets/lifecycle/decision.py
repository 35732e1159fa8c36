"""The resume decision for one ended training run: gather the facts, decide once, record.

The sensors (`ckpt_assets.defs.sensors`) call `consider` for each ended training run they see.
It reads how the attempt ended into one `AttemptEnd` (from the step's failure record, or,
for a run that recorded none, from how Dagster saw it end), applies the failure policy
(`ckpt_assets.lifecycle.policy`) once, writes the decision where the sensors and people look, and
returns the resume's `RunRequest` once it is due.

Exactly once: a decision is written onto the failed run's tags before anything is
launched; a resume's run_key is derived from the failed run's id; only the newest run of
a partition is ever acted on (a resume, once created, is newer); and the run queue admits
one active run per partition.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, replace

import dagster as dg

from ckpt_assets.attempt.end import AttemptEnd
from ckpt_assets.lifecycle.policy import Budget, Decision, decide
from ckpt_assets.lifecycle.state import report_state
from ckpt_assets.lifecycle.stop import stop_reason_text
from ckpt_assets.records.metadata import to_metadata
from ckpt_assets.runs.clock import iso, parse_time
from ckpt_assets.runs.dagster_private import report_engine_event
from ckpt_assets.runs.names import TRAIN_JOB
from ckpt_assets.runs.queries import is_training_run, newest_training_run
from ckpt_assets.runs.registration import read_registration
from ckpt_assets.runs.settings import ResumeSettings
from ckpt_assets.runs.store import StoreSource
from ckpt_assets.runs.tags import (
    PARTITION_TAG,
    TAG_ATTEMPT,
    TAG_BUDGET,
    TAG_DECIDED_AT,
    TAG_DECISION,
    TAG_DECISION_REASON,
    TAG_FAILURE_KIND,
    TAG_HEARTBEAT_LOST,
    TAG_NEXT_BUDGET,
    TAG_NO_RESUME,
    TAG_PARENT_RUN_ID,
    TAG_RESUME_AT,
    TAG_RESUME_FROM,
    TAG_ROOT_RUN_ID,
    TAG_STALLED,
    TAG_STOP_REASON,
)
from trainer.outcomes import Kind, Outcome
from trainer.repo import CheckpointRepo

RESUME_KEY_PREFIX = "resume-"


# The reconciler's verdict on a STARTED run's trainer, tagged on the run before it acts
# (`ckpt_assets.lifecycle.liveness`): it, not the trainer's exit that the reconciler caused, is how
# the attempt ended.
LIVENESS_TAGS = {Outcome.HEARTBEAT_LOST: TAG_HEARTBEAT_LOST, Outcome.STALLED: TAG_STALLED}


def liveness_outcome(run: dg.DagsterRun) -> Outcome | None:
    return next((o for o, tag in LIVENESS_TAGS.items() if run.tags.get(tag)), None)


def recorded_end(instance: dg.DagsterInstance, run: dg.DagsterRun) -> AttemptEnd | None:
    """The attempt's own record of how it ended: the last step failure that carries one."""
    reported = None
    for rec in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE):
        data = rec.dagster_event.step_failure_data
        ufd = data.user_failure_data if data else None
        if ufd:
            reported = AttemptEnd.from_metadata(
                {k: v.value for k, v in ufd.metadata.items()}) or reported
    return reported


def failure_of(instance: dg.DagsterInstance, run: dg.DagsterRun,
               store: StoreSource | None) -> AttemptEnd:
    """How `run` ended: the reconciler's verdict on its trainer, else its own record, else
    what Dagster (and the store) saw of it."""
    reported = recorded_end(instance, run)
    liveness = liveness_outcome(run)
    if reported is not None:
        reported = replace(reported, dagster_run_id=run.run_id,
                           attempt=reported.attempt or int(run.tags.get(TAG_ATTEMPT, "1") or 1))
        # Declared dead or stalled: the trainer's exit is what the reconciler did to it.
        if liveness is None:
            return reported
        return replace(reported, outcome=liveness, message=run.tags[LIVENESS_TAGS[liveness]])
    partition = run.tags[PARTITION_TAG]
    if liveness is not None:
        outcome = liveness
    elif run.status == dg.DagsterRunStatus.CANCELED:
        outcome = Outcome.TERMINATED
    else:
        outcome = Outcome.WORKER_LOST
    return AttemptEnd(outcome, partition, attempt=int(run.tags.get(TAG_ATTEMPT, "1") or 1),
                      last_committed_step=committed_step(store, partition) if store else None,
                      dagster_run_id=run.run_id,
                      message=run.tags.get(LIVENESS_TAGS[liveness]) if liveness else None)


def run_repo(store: StoreSource, partition: str) -> CheckpointRepo | None:
    s = store.open()
    reg = read_registration(s, partition)
    return CheckpointRepo(s, reg.experiment, partition) if reg else None


def committed_step(store: StoreSource, partition: str) -> int | None:
    try:
        repo = run_repo(store, partition)
        ptr = repo.read_pointer() if repo else None
    except Exception:  # an unreadable store must not stop the decision; the step is a hint
        return None
    return ptr.step if ptr and ptr.checkpoint else None


def budget_of(run: dg.DagsterRun, tag: str = TAG_BUDGET) -> Budget:
    return Budget.from_tag(run.tags.get(tag, ""))


def decision_words(decision: Decision, run_key: str) -> str:
    """The decision in words, for the failed run's own log."""
    if not decision.resume:
        return f"Not resumed ({decision.kind}): {decision.reason.removeprefix('not resumed: ')}"
    if decision.delay_s > 0:
        return (f"Will be resumed after a back-off of {decision.delay_s:.0f}s "
                f"({decision.kind}): {decision.reason}. The resume's run key is {run_key}.")
    return (f"Resuming now ({decision.kind}): {decision.reason}. The resume's run key is "
            f"{run_key}; it records its run id on this run when it starts.")


def record(instance: dg.DagsterInstance, run: dg.DagsterRun, failure: AttemptEnd,
           decision: Decision) -> None:
    """Write the decision where the reconciler and people look: the failed run's tags (what
    the sensors act on), its own log in words, and the partition's new state."""
    # Rounded down: a decision time in the future would look not yet due.
    decided = math.floor(time.time() * 1000) / 1000
    tags = {TAG_DECISION: "resume" if decision.resume else "stop",
            TAG_DECISION_REASON: decision.reason[:400], TAG_FAILURE_KIND: decision.kind.value,
            TAG_DECIDED_AT: iso(decided), TAG_NEXT_BUDGET: decision.budget.to_tag(),
            **({TAG_RESUME_AT: iso(decided + decision.delay_s)}
               if decision.resume and decision.delay_s > 0 else {})}
    instance.add_run_tags(run.run_id, tags)
    run_key = f"{RESUME_KEY_PREFIX}{run.run_id}"
    facts = to_metadata({
        "failed_run_id": run.run_id, "decision": tags[TAG_DECISION], "reason": decision.reason,
        "failure_kind": decision.kind.value, "exit_code": failure.exit_code,
        "failure_class": failure.outcome.value,
        "last_committed_step": failure.last_committed_step, "attempt": failure.attempt,
        "delay_s": float(decision.delay_s), "budget": asdict(decision.budget),
        "resume_run_key": run_key if decision.resume else None})
    # In words, in the failed run's own log, where whoever opens that run looks first. The
    # resume's run id does not exist yet (the daemon assigns it at launch): the resume links
    # back to this run, and tags it `ckpt/resumed_by`, once it starts.
    try:
        report_engine_event(instance, run, decision_words(decision, run_key), facts)
    except Exception:  # the tags above are the record the sensors act on; this is for people
        logging.getLogger(__name__).warning("could not log the resume decision on run %s",
                                            run.run_id, exc_info=True)
    report_state(instance, failure.training_run, facts)


def resume_request(run: dg.DagsterRun, failure: AttemptEnd,
                   store: StoreSource | None) -> dg.RunRequest:
    resume_from = ""
    if store is not None and failure.last_committed_step is not None:
        try:
            repo = run_repo(store, failure.training_run)
            ptr = repo.read_pointer() if repo else None
            resume_from = repo.uri(ptr.checkpoint) if ptr and ptr.checkpoint else ""
        except Exception:
            resume_from = ""
    return dg.RunRequest(
        run_key=f"{RESUME_KEY_PREFIX}{run.run_id}",
        partition_key=failure.training_run,
        job_name=TRAIN_JOB,
        tags={TAG_PARENT_RUN_ID: run.run_id,
              TAG_ROOT_RUN_ID: run.tags.get(TAG_ROOT_RUN_ID, run.run_id),
              TAG_ATTEMPT: str(failure.attempt + 1),
              TAG_RESUME_FROM: resume_from or "latest",
              TAG_BUDGET: run.tags.get(TAG_NEXT_BUDGET, "")},
    )


def consider(instance: dg.DagsterInstance, run: dg.DagsterRun, store: StoreSource | None,
             sweep: bool, settings: ResumeSettings | None = None) -> dg.RunRequest | None:
    """Decide about one ended training run (once) and return its resume if it is due now.

    The failure sensors (sweep=False) launch immediate resumes; the reconciler (sweep=True)
    launches backed-off ones when due, and immediate ones the sensors did not launch in time.
    """
    if not is_training_run(run):
        return None
    newest = newest_training_run(instance, run.tags[PARTITION_TAG])
    if newest is None or newest.run_id != run.run_id:
        return None  # a newer run of this partition exists (e.g. the resume): moot
    settings = settings or ResumeSettings.from_env()
    failure = None
    decided_here = TAG_DECISION not in run.tags
    if decided_here:
        failure = failure_of(instance, run, store)
        if run.tags.get(TAG_NO_RESUME) == "true":
            decision = Decision(False, Kind.STOPPED_BY_USER,
                                stop_reason_text(run.tags.get(TAG_STOP_REASON)))
        else:
            decision = decide(failure, budget_of(run), settings.policy)
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
    elif sweep and not decided_here and now < decided_at + settings.launch_grace_s:
        return None  # the failure sensor's launch may still be on its way
    # Decided here by the sweep: no sensor decided it, so no launch of theirs is on its way,
    # and the sweep only decides a run the grace after its end (a second grace from this
    # decision held every resume the sensors missed for two).
    return resume_request(run, failure or failure_of(instance, run, store), store)
