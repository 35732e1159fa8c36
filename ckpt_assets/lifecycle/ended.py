"""How an ended attempt ended, read from what it and Dagster recorded; nothing here writes.

The decision (`lifecycle.decision`), the in-run relaunch, the reconciler's liveness, `list`
and `ckpt-assets run` read an attempt's end here, and the step names it here before it
records it (`named_end`): one name wherever it is read. An action on the run, tagged or
marked on it before it is carried out, names the end over the trainer's exit that it caused:
the reconciler's verdict on the trainer, a stop for good, a terminate of the Dagster run.
Without the attempt's own record (its step failure's `AttemptEnd`), the end is what Dagster
saw: one of those actions, or its worker lost.
"""

from __future__ import annotations

from dataclasses import replace

import dagster as dg

from ckpt_assets.base.attempt_processes import AttemptProcesses
from ckpt_assets.base.end import AttemptEnd
from ckpt_assets.base.events import ATTEMPT_ENDED
from ckpt_assets.base.registration import read_registration
from ckpt_assets.base.store import StoreSource
from ckpt_assets.base.tags import TAG_HEARTBEAT_LOST, TAG_STALLED
from ckpt_assets.base.view import RunView
from trainer.base.outcomes import Outcome
from trainer.checkpoints.repo import CheckpointRepo

# The reconciler's verdict on a STARTED run's trainer, tagged on the run before it acts
# (`lifecycle.liveness`): it, not the trainer's exit that the reconciler caused, is how
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


def stop_reason_text(reason: str | None) -> str:
    return f"not resumed: stopped on request ({reason})" if reason else \
        "not resumed: stopped on request"


# A trainer's exit that only echoes an action on its run: the SIGTERM of a stop or a
# terminate (143), a signal's kill, or no exit seen at all.
ECHOES = (Outcome.PREEMPTED, Outcome.KILLED_BY_SIGNAL, Outcome.WORKER_LOST)
ENDING = (dg.DagsterRunStatus.CANCELING, dg.DagsterRunStatus.CANCELED)


def named_end(run: dg.DagsterRun, ended: AttemptEnd,
              status: dg.DagsterRunStatus | None = None) -> AttemptEnd:
    """`ended` under its one name: the reconciler's verdict (`heartbeat_lost`, `stalled`),
    a stop for good (`stopped_by_user`, its reason the message), a terminate of the Dagster
    run (`terminated`, over the exit it caused), else the trainer's own. `run` as read after
    the trainer ended; `status`: its end status where its record may not say so yet."""
    if not ended.outcome.failed:
        return ended
    liveness = liveness_outcome(run)
    if liveness is not None:
        return replace(ended, outcome=liveness, message=run.tags[LIVENESS_TAGS[liveness]])
    view = RunView.of(run)
    if view.stop_requested:
        return replace(ended, outcome=Outcome.STOPPED_BY_USER,
                       message=stop_reason_text(view.stop_reason))
    if (status or run.status) in ENDING and ended.outcome in ECHOES:
        return replace(ended, outcome=Outcome.TERMINATED)
    return ended


def failure_of(instance: dg.DagsterInstance, run: dg.DagsterRun, store: StoreSource | None,
               ended_as: dg.DagsterRunStatus | None = None) -> AttemptEnd:
    """How `run` ended (`named_end`): its own record if it has one, else what Dagster and
    the store saw of it; `ended_as`: its end status from its end event, when its record may
    not say so yet."""
    return failure_from(run, recorded_end(instance, run), store, ended_as)


def failure_from(run: dg.DagsterRun, reported: AttemptEnd | None, store: StoreSource | None,
                 ended_as: dg.DagsterRunStatus | None = None) -> AttemptEnd:
    """`failure_of` with the attempt's own record (`recorded_end`) read already."""
    if reported is not None:
        return named_end(run, replace(reported, dagster_run_id=run.run_id,
                                      attempt=reported.attempt or RunView.of(run).attempt),
                         ended_as)
    partition = RunView.of(run).partition
    return named_end(run, AttemptEnd(
        Outcome.WORKER_LOST, partition, attempt=RunView.of(run).attempt,
        last_committed_step=committed_step(store, partition) if store else None,
        dagster_run_id=run.run_id), ended_as)


def end_observed(instance: dg.DagsterInstance, run: dg.DagsterRun, attempt: int) -> bool:
    """Whether attempt `attempt` of `run` recorded its `attempt_ended` observation (a run
    interrupted by Dagster records it, though its step failure carries no record)."""
    for rec in instance.all_logs(run.run_id, of_type=dg.DagsterEventType.ASSET_OBSERVATION):
        obs = rec.dagster_event.asset_observation_data.asset_observation
        md = obs.metadata
        if "event" in md and md["event"].value == ATTEMPT_ENDED and \
                "attempt" in md and md["attempt"].value == attempt:
            return True
    return False


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


# A run whose worker can die unseen: one that runs, and one that is being terminated (a stop
# or a terminate after its worker died waits on a worker that will never answer).
LIVE = (dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING)


def lost_worker(run: dg.DagsterRun) -> AttemptProcesses | None:
    """`run`'s processes if it is STARTED or CANCELING and its run worker is known dead (it
    ran on this machine and its process is gone); None otherwise (a worker elsewhere is the
    heartbeat's to judge, or run monitoring's cancel timeout's). Seeing it is a read, done
    by anyone; ending it is `lifecycle.lost_worker`'s."""
    if run.status not in LIVE:
        return None
    return died(run)


def died(run: dg.DagsterRun) -> AttemptProcesses | None:
    """`run`'s processes if its run worker is known to have died before it ended its attempt
    (whatever the run's status now), else None."""
    procs = AttemptProcesses.of_run(run)
    if procs is None or procs.ended or not procs.worker_gone():
        return None
    return procs


def lost_words(procs: AttemptProcesses) -> str:
    return (f"its run worker (pid {procs.worker.pid}) is gone: the attempt ended without "
            f"recording how its training process exited (its output: {procs.output})")
