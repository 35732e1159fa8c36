"""How an ended attempt ended, read from what it and Dagster recorded; nothing here writes.

The decision (`lifecycle.decision`), the in-run relaunch, the reconciler's liveness, `list`
and `ckpt-assets run` read an attempt's end here: the reconciler's verdict on its trainer
if it gave one, else the attempt's own record (its step failure's `AttemptEnd`), else what
Dagster saw (stopped for good by a user, terminated, or its worker lost).
"""

from __future__ import annotations

from dataclasses import replace

import dagster as dg

from ckpt_assets.base.end import AttemptEnd
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


def failure_of(instance: dg.DagsterInstance, run: dg.DagsterRun, store: StoreSource | None,
               ended_as: dg.DagsterRunStatus | None = None) -> AttemptEnd:
    """How `run` ended: the reconciler's verdict on its trainer, else its own record, else
    what Dagster (and the store) saw of it; `ended_as`: its end status from its end event,
    when its record may not say so yet."""
    reported = recorded_end(instance, run)
    liveness = liveness_outcome(run)
    if reported is not None:
        reported = replace(reported, dagster_run_id=run.run_id,
                           attempt=reported.attempt or RunView.of(run).attempt)
        # Declared dead or stalled: the trainer's exit is what the reconciler did to it.
        if liveness is None:
            return reported
        return replace(reported, outcome=liveness, message=run.tags[LIVENESS_TAGS[liveness]])
    view = RunView.of(run)
    partition = view.partition
    if liveness is not None:
        outcome = liveness
    elif view.stop_requested:
        outcome = Outcome.STOPPED_BY_USER  # one name for a stop, wherever it is read
    elif (ended_as or run.status) == dg.DagsterRunStatus.CANCELED:
        outcome = Outcome.TERMINATED
    else:
        outcome = Outcome.WORKER_LOST
    return AttemptEnd(outcome, partition, attempt=view.attempt,
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
