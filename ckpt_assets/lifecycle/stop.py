"""Stop a training run for good: end its active Dagster runs so that nothing resumes it.

Terminating a run from the Dagster UI is a preemption notice (the trainer commits and
exits 143) and the resume sensors resume it. Stopping is different: every active run of
the partition is tagged `ckpt/no_resume=true` (the sensors' `TAG_NO_RESUME`) BEFORE it is
terminated, so the sensor that sees it end already reads the tag and records "stop".

A run that already ended with a resume still pending (a backed-off resume the reconciler
launches later, or a failure not decided yet) is withdrawn as well: without that, a stop
issued during the back-off would be undone by the reconciler minutes later.

Used by the `stop_training_run` job (ckpt_assets.defs.jobs) and by `ckpt-assets stop`: the
move `stopped by user` of the lifecycle table, made through `lifecycle.transition`.
"""

from __future__ import annotations

from dataclasses import dataclass

import dagster as dg

from ckpt_assets.base.names import PARTITIONS_NAME
from ckpt_assets.base.queries import (
    ENDED_UNSUCCESSFULLY,
    active_runs,
    newest_training_run,
)
from ckpt_assets.base.registration import validate_partition_key
from ckpt_assets.base.tags import (
    PARTITION_TAG,
    TAG_DECISION,
    TAG_NO_RESUME,
    TAG_STOP_REASON,
)
from ckpt_assets.lifecycle.ended import lost_worker, stop_reason_text
from ckpt_assets.lifecycle.lost_worker import end_lost_attempt
from ckpt_assets.lifecycle.model import Event, NotAMove
from ckpt_assets.lifecycle.transition import Writes, transition

# What happened to one run (StopAction.action):
CANCELED = "canceled from the queue"
TERMINATING = "terminating: the trainer commits a checkpoint and exits"
ALREADY_CANCELING = "already canceling"
NOT_REACHED = ("termination requested, but its run worker could not be reached; run "
               "monitoring marks it canceled (or stop again with force)")
MARKED_CANCELED = "marked canceled (forced)"
RESUME_WITHDRAWN = "ended already: its pending resume is withdrawn"
WORKER_GONE = ("its run worker is gone: canceled at once, what its attempt left running "
               "asked to stop")


@dataclass(frozen=True)
class StopAction:
    run_id: str
    status: str  # the run's status when it was found
    action: str

    def __str__(self) -> str:
        return f"run {self.run_id} ({self.status}): {self.action}"


def stop_request(instance: dg.DagsterInstance, run_id: str) -> str | None:
    """Why run `run_id` was stopped for good (`stop_reason_text`), read fresh: the stop tags
    a run before ending it, after its step read its tags; None if it was not stopped."""
    run = instance.get_run_by_id(run_id)
    if run is None or run.tags.get(TAG_NO_RESUME) != "true":
        return None
    return stop_reason_text(run.tags.get(TAG_STOP_REASON))


def stop_training_run(instance: dg.DagsterInstance, partition: str, reason: str | None = None,
                      *, force: bool = False) -> list[StopAction]:
    """Stop training run `partition` for good; one StopAction per run acted on (none: there
    was nothing to stop, e.g. it finished). Raises ConfigError for a malformed name.

    `force`: a run whose termination was requested is also marked canceled at once (as the
    UI's "force termination" does), for a run worker that is gone.
    """
    validate_partition_key(partition)
    tags = {TAG_NO_RESUME: "true", **({TAG_STOP_REASON: reason[:400]} if reason else {})}

    def stop(w: Writes) -> list[StopAction]:
        # First the newest ended run, then the active ones: a resume launched in between is
        # active by the time they are listed.
        actions = _withdraw_pending_resume(w, partition, tags)
        for run in active_runs(instance, partition):
            w.tag(run.run_id, tags)  # before terminating: the sensors read it
            actions.append(StopAction(run.run_id, run.status.value, _end(w, run, force)))
        if not actions:
            w.unmoved()
        return actions

    try:
        return transition(instance, partition, Event.STOP_REQUESTED, stop).result
    except NotAMove:
        return []  # not launched, finished or stopped already: nothing to stop


def _end(w: Writes, run: dg.DagsterRun, force: bool) -> str:
    if run.status == dg.DagsterRunStatus.QUEUED:
        # What QueuedRunCoordinator.cancel_run does for a queued run; done here so that it
        # holds for any run coordinator (a queued run has no process to stop).
        w.cancel_queued(run, "Stopping the training run for good.",
                        "Stopped for good; it will not be resumed.")
        return CANCELED
    if lost_worker(run) is not None:
        return _end_lost(w, run)
    if run.status == dg.DagsterRunStatus.CANCELING:
        action = ALREADY_CANCELING
    else:
        action = TERMINATING if _terminate(w, run) else NOT_REACHED
    if force:
        current = w.instance.get_run_by_id(run.run_id)
        if current is not None and not current.is_finished:
            w.mark_canceled(current, "Stopped for good and forcibly marked canceled; the run "
                                     "worker's resources may not have been cleaned up.")
            return MARKED_CANCELED
    return action


def _end_lost(w: Writes, run: dg.DagsterRun) -> str:
    """A run whose worker is known dead is ended here, by the lost worker's own move:
    nothing would answer a termination request (the code server's wait for the dead worker
    held the stop for a minute, then failed), and run monitoring would cancel it only after
    its cancel timeout."""
    if run.status != dg.DagsterRunStatus.CANCELING:
        w.canceling(run, "Stopping the training run for good; its run worker is gone.")
        run = w.instance.get_run_by_id(run.run_id) or run
    end_lost_attempt(w.instance, run)
    return WORKER_GONE


def _terminate(w: Writes, run: dg.DagsterRun) -> bool:
    try:
        return w.terminate_run(run.run_id)
    except Exception as e:  # a launcher that cannot terminate: the tag still stops resumes
        w.instance.report_engine_event(f"Could not request termination: {e}", dagster_run=run)
        return False


def _withdraw_pending_resume(w: Writes, partition: str,
                             tags: dict[str, str]) -> list[StopAction]:
    newest = newest_training_run(w.instance, partition)
    if newest is None or newest.status not in ENDED_UNSUCCESSFULLY:
        return []
    decision = newest.tags.get(TAG_DECISION)
    if decision == "stop" or newest.tags.get(TAG_NO_RESUME) == "true":
        return []  # nothing pending: it was stopped already, or will never be resumed
    # Undecided: the sensors decide "stop" when they see the tag. Decided "resume" but not
    # launched (only the newest run of a partition is ever resumed): the decision stands as
    # it was made (it is a record, never rewritten); ckpt/no_resume withdraws its resume,
    # and every reader (the launcher, the state, lineage) reads the stop first.
    w.tag(newest.run_id, dict(tags))
    return [StopAction(newest.run_id, newest.status.value, RESUME_WITHDRAWN)]


def is_known(instance: dg.DagsterInstance, partition: str) -> bool:
    """The partition exists or has runs (a typo in the name is neither)."""
    return instance.has_dynamic_partition(PARTITIONS_NAME, partition) or bool(
        instance.get_runs(filters=dg.RunsFilter(tags={PARTITION_TAG: partition}), limit=1))
