"""The resume decision for one ended training run: gather the facts, decide once, record.

The sensors (`ckpt_assets.defs.sensors`) call `consider` for each ended training run they see.
It reads how the attempt ended into one `AttemptEnd` (from the step's failure record, or,
for a run that recorded none, from how Dagster saw it end), applies the failure policy
(`ckpt_assets.lifecycle.policy`) once, and writes the decision where the sensors and people
look. `due_resume` is the resume's `RunRequest` once it is due; only the reconciler asks.

Exactly once: a decision is created once in the checkpoint store
(`lifecycle.decision_record`) before anything is launched, and every later reader acts on
that one. One sensor launches resumes (the reconciler), and a resume's run_key is derived
from the failed run's id: Dagster launches a run_key once per sensor, so a failure is
resumed once whichever sensor decided it and however often the decision is read. Only the
newest run of a partition is ever acted on (a resume, once created, is newer), and the run
queue admits one active run per partition.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict
from typing import Any

import dagster as dg

from ckpt_assets.base.dagster_private import report_engine_event
from ckpt_assets.base.end import AttemptEnd
from ckpt_assets.base.metadata import to_metadata
from ckpt_assets.base.names import TRAIN_JOB
from ckpt_assets.base.queries import is_training_run, newest_training_run
from ckpt_assets.base.store import StoreSource
from ckpt_assets.base.tags import (
    PARTITION_TAG,
    TAG_BUDGET,
    TAG_DECISION,
    TAG_RESUME_FROM,
)
from ckpt_assets.base.view import RunView
from ckpt_assets.lifecycle.decision_record import DecisionRecord, mirror_tags, read_decision
from ckpt_assets.lifecycle.ended import (
    died,
    end_observed,
    failure_from,
    recorded_end,
    run_repo,
    stop_reason_text,
)
from ckpt_assets.lifecycle.lost_worker import record_lost_end
from ckpt_assets.lifecycle.model import Event
from ckpt_assets.lifecycle.policy import Budget, Decision, decide
from ckpt_assets.lifecycle.settings import ResumeSettings
from ckpt_assets.lifecycle.transition import Writes, put_back, transition
from trainer.base.outcomes import Kind

RESUME_KEY_PREFIX = "resume-"
_LOG = logging.getLogger(__name__)


def decision_words(decision: Decision, run_key: str) -> str:
    """The decision in words, for the failed run's own log."""
    if not decision.resume:
        return f"Not resumed ({decision.kind}): {decision.reason.removeprefix('not resumed: ')}"
    if decision.delay_s > 0:
        return (f"Will be resumed after a back-off of {decision.delay_s:.0f}s "
                f"({decision.kind}): {decision.reason}. The resume's run key is {run_key}.")
    return (f"Resuming now ({decision.kind}): {decision.reason}. The resume's run key is "
            f"{run_key}; it records its run id on this run when it starts.")


def decision_of(run: dg.DagsterRun, store: StoreSource) -> DecisionRecord | None:
    """The decision about `run`: the store's create-once record (the tags only mirror it)."""
    return read_decision(store.open(), RunView.of(run).partition, run.run_id)


def record(instance: dg.DagsterInstance, run: dg.DagsterRun, failure: AttemptEnd,
           decision: Decision, store: StoreSource, lost: bool = False,
           tracking=None) -> tuple[DecisionRecord, bool]:
    """Create the decision once (`decision_record.create_once`): the move `decided: ...` of
    the run as it ended (`run`); if this call made it, say it where people look: the failed
    run's tags, its own log in words, the partition's new state. `lost`: the attempt
    recorded no end of its own, recorded first (`record_lost_end`, with `tracking`), so that
    a reader who sees the decision sees it. Returns (the decision that holds, whether this
    call made it)."""
    # Rounded down: a decision time in the future would look not yet due.
    decided = math.floor(time.time() * 1000) / 1000
    rec = DecisionRecord(
        run.run_id, failure.training_run, decision.resume, decision.kind.value,
        failure.outcome.value, decision.reason, decided,
        decided + decision.delay_s if decision.resume and decision.delay_s > 0 else None,
        decision.budget.to_tag(), failure.attempt, failure.last_committed_step)
    facts = _facts(run, failure, decision)

    def create(w: Writes) -> tuple[DecisionRecord, bool]:
        made, created = w.decide(store.open(), rec)
        if not created:
            w.unmoved()  # another decider was first: its move is the one recorded
            return made, created
        if lost:
            record_lost_end(w, failure, made, store, tracking)
        mirror = mirror_tags(made)
        w.tag(run.run_id, mirror)
        _say(instance, run.with_tags({**run.tags, **mirror}), decision, facts)
        return made, created

    event = (Event.DECIDED_STOP if not decision.resume else
             Event.DECIDED_BACKOFF if decision.delay_s > 0 else Event.DECIDED_RESUME)
    return transition(instance, failure.training_run, event, create, run=run,
                      extra=facts).result


def _facts(run: dg.DagsterRun, failure: AttemptEnd, decision: Decision) -> dict[str, Any]:
    return to_metadata({
        "failed_run_id": run.run_id, "decision": "resume" if decision.resume else "stop",
        "reason": decision.reason, "failure_kind": decision.kind.value,
        "exit_code": failure.exit_code, "failure_class": failure.outcome.value,
        "last_committed_step": failure.last_committed_step, "attempt": failure.attempt,
        "delay_s": float(decision.delay_s), "budget": asdict(decision.budget),
        "resume_run_key": f"{RESUME_KEY_PREFIX}{run.run_id}" if decision.resume else None})


def _say(instance: dg.DagsterInstance, run: dg.DagsterRun, decision: Decision,
         facts: dict[str, Any]) -> None:
    # In words, in the failed run's own log, where whoever opens that run looks first. The
    # resume's run id does not exist yet (the daemon assigns it at launch): the resume links
    # back to this run, and tags it `ckpt/resumed_by`, once it starts.
    try:
        report_engine_event(instance, run,
                            decision_words(decision, f"{RESUME_KEY_PREFIX}{run.run_id}"),
                            facts)
    except Exception:  # the record is what the sensors act on; this is for people
        _LOG.warning("could not log the resume decision on run %s", run.run_id,
                     exc_info=True)


def resume_request(run: dg.DagsterRun, rec: DecisionRecord,
                   store: StoreSource) -> dg.RunRequest:
    resume_from = ""
    if rec.last_committed_step is not None:
        try:
            repo = run_repo(store, rec.training_run)
            ptr = repo.read_pointer() if repo else None
            resume_from = repo.uri(ptr.checkpoint) if ptr and ptr.checkpoint else ""
        except Exception:
            resume_from = ""
    view = RunView.of(run)
    return dg.RunRequest(
        run_key=f"{RESUME_KEY_PREFIX}{run.run_id}",
        partition_key=rec.training_run,
        job_name=TRAIN_JOB,
        # The chain's interrupted attempts, this one named as its decision names it.
        tags={**view.next_attempt_tags(rec.attempt + 1, (rec.attempt, rec.failure_class)
                                       if rec.failure_class else None),
              TAG_RESUME_FROM: resume_from or "latest", TAG_BUDGET: rec.next_budget},
    )


def _decide(instance: dg.DagsterInstance, run: dg.DagsterRun, store: StoreSource,
            settings: ResumeSettings, ended_as: dg.DagsterRunStatus | None,
            tracking=None) -> tuple[DecisionRecord, bool]:
    reported = recorded_end(instance, run)
    failure = failure_from(run, reported, store, ended_as)
    # The run as it ended: its record may not say so yet (`consider`).
    run = run.with_status(ended_as) if ended_as is not None else run
    view = RunView.of(run)
    if view.stop_requested:
        decision = Decision(False, Kind.STOPPED_BY_USER, stop_reason_text(view.stop_reason))
    else:
        own = settings.of_run(store.open(), failure.training_run)
        decision = decide(failure, Budget.from_tag(view.budget), own.policy)
    # A worker alive (a run the reconciler failed) records the end itself, moments later;
    # one elsewhere cannot be told dead from here, and records it if it lives.
    lost = reported is None and died(run) is not None \
        and not end_observed(instance, run, failure.attempt)
    return record(instance, run, failure, decision, store, lost, tracking)


def consider(instance: dg.DagsterInstance, run: dg.DagsterRun, store: StoreSource,
             settings: ResumeSettings | None = None,
             ended_as: dg.DagsterRunStatus | None = None, tracking=None
             ) -> DecisionRecord | None:
    """Decide about one ended training run once, and return the decision that holds (None:
    not a training run, or a newer run of its partition exists and the decision is moot).
    `ended_as`: how the run ended, from its end event, when its record may not say so yet;
    `tracking`: the MLflow resource, for a lost attempt's end (`record_lost_end`)."""
    if not is_training_run(run):
        return None
    newest = newest_training_run(instance, run.tags[PARTITION_TAG])
    if newest is None or newest.run_id != run.run_id:
        return None  # a newer run of this partition exists (e.g. the resume): moot
    rec = decision_of(newest, store)
    if rec is None:  # decided over the run as read now: a stop tags it before it ends it
        rec, _ = _decide(instance, newest, store, settings or ResumeSettings.from_env(),
                         ended_as, tracking)
    elif TAG_DECISION not in newest.tags:  # the mirror was dropped by a concurrent rewrite
        put_back(instance, run.run_id, mirror_tags(rec))
    return rec


def due_resume(instance: dg.DagsterInstance, run: dg.DagsterRun, store: StoreSource,
               settings: ResumeSettings | None = None,
               now: float | None = None, tracking=None) -> dg.RunRequest | None:
    """The resume of one ended training run, decided once (`consider`), if it is due now:
    at once, or once its back-off ended; never once a stop withdrew it. Asked by the one
    sensor that launches resumes, so its run_key is launched once."""
    out = resume_or_wait(instance, run, store, settings, now, tracking)
    return out if isinstance(out, dg.RunRequest) else None


def resume_or_wait(instance: dg.DagsterInstance, run: dg.DagsterRun, store: StoreSource,
                   settings: ResumeSettings | None = None,
                   now: float | None = None, tracking=None) -> dg.RunRequest | float | None:
    """`due_resume`'s request; or, for a resume whose back-off has not ended, the time it
    ends (the reconciler waits for it by run id); or None: nothing to launch, ever."""
    rec = consider(instance, run, store, settings, tracking=tracking)
    if rec is None or not rec.resume:
        return None
    current = instance.get_run_by_id(run.run_id) or run
    if RunView.of(current).stop_requested:
        return None  # the resume was withdrawn by a stop
    if rec.resume_at is not None and (time.time() if now is None else now) < rec.resume_at:
        return rec.resume_at  # a back-off, not over yet
    return resume_request(current, rec, store)
