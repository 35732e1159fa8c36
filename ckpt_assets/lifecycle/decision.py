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
from dataclasses import asdict

import dagster as dg

from ckpt_assets.attempt.end import AttemptEnd
from ckpt_assets.lifecycle.ended import failure_of, run_repo
from ckpt_assets.lifecycle.policy import Budget, Decision, decide
from ckpt_assets.lifecycle.state import report_state
from ckpt_assets.lifecycle.stop import stop_reason_text
from ckpt_assets.records.metadata import to_metadata
from ckpt_assets.runs.clock import iso, parse_time
from ckpt_assets.runs.dagster_private import report_engine_event
from ckpt_assets.runs.names import TRAIN_JOB
from ckpt_assets.runs.queries import is_training_run, newest_training_run
from ckpt_assets.runs.settings import ResumeSettings
from ckpt_assets.runs.store import StoreSource
from ckpt_assets.runs.tags import (
    PARTITION_TAG,
    TAG_ATTEMPT,
    TAG_BUDGET,
    TAG_DECIDED_AT,
    TAG_DECISION,
    TAG_DECISION_REASON,
    TAG_FAILURE_CLASS,
    TAG_FAILURE_KIND,
    TAG_NEXT_BUDGET,
    TAG_NO_RESUME,
    TAG_PARENT_RUN_ID,
    TAG_RESUME_AT,
    TAG_RESUME_FROM,
    TAG_ROOT_RUN_ID,
    TAG_STOP_REASON,
)
from trainer.outcomes import Kind

RESUME_KEY_PREFIX = "resume-"


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
            TAG_FAILURE_CLASS: failure.outcome.value,
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
