"""An attempt whose run worker died without recording how its trainer exited, ended.

Seeing it is a read (`lifecycle.ended.lost_worker`: the run's recorded processes say its
worker ran on this machine and is gone), done by anyone: `list`, `lineage`, the state check.
Ending it is the move `run worker lost`, owned here (`end_lost_attempt`) and asked for by
every tick of the reconciler (`end_lost_attempts`: a query of the live runs and a look at
this machine's processes, no store read, so a lost worker costs its run at most a tick) and
by a launch by hand of the same training run (`ckpt-assets run`, `launch`, the
`new_training_run` job), which must chain onto it as its resume would. The run is failed
(decided by the reconciler, in the same tick when its tick ended it) and what its attempt
left running is asked to stop (the trainer commits and exits 143).
"""

from __future__ import annotations

import logging
from contextlib import suppress
from dataclasses import replace

import dagster as dg

from ckpt_assets.base.end import AttemptEnd
from ckpt_assets.base.events import ATTEMPT_ENDED, MODEL_CHECKPOINT_KEY
from ckpt_assets.base.metadata import to_metadata
from ckpt_assets.base.queries import is_training_run
from ckpt_assets.base.store import StoreSource
from ckpt_assets.base.tags import PARTITION_TAG, TAG_WORKER_LOST
from ckpt_assets.lifecycle.decision_record import DecisionRecord
from ckpt_assets.lifecycle.ended import LIVE, lost_words, lost_worker, run_repo
from ckpt_assets.lifecycle.model import Event, NotAMove
from ckpt_assets.lifecycle.transition import Writes, transition
from ckpt_assets.mlflow.run import MlflowRun
from trainer.base.outcomes import Kind

_LOG = logging.getLogger(__name__)


def end_lost_attempt(instance: dg.DagsterInstance, run: dg.DagsterRun) -> dg.DagsterRun:
    """`run` ended if its worker is known dead (what its attempt left running asked to stop),
    else `run` unchanged: failed as `worker_lost`, or canceled if it was being terminated
    (at once, not after run monitoring's cancel timeout: nothing is left to wait for)."""
    procs = lost_worker(run)
    if procs is None:
        return run
    msg = lost_words(procs)

    def end(w: Writes) -> None:
        w.tag(run.run_id, {TAG_WORKER_LOST: msg})
        if run.status == dg.DagsterRunStatus.CANCELING:
            w.mark_canceled(run, msg)
        else:
            w.fail(run, msg)
        procs.stop(0.0, _LOG, wait=False)

    with suppress(NotAMove):  # e.g. stopped for good meanwhile: the stop ends it
        transition(instance, run.tags[PARTITION_TAG], Event.WORKER_LOST, end, run=run)
    return instance.get_run_by_id(run.run_id) or run


def end_lost_attempts(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    """Every live training run whose run worker is known dead, ended (`end_lost_attempt`),
    as it reads now: the runs the reconciler decides and resumes in the same tick."""
    return [end_lost_attempt(instance, run)
            for run in instance.get_runs(filters=dg.RunsFilter(statuses=list(LIVE)))
            if is_training_run(run) and lost_worker(run) is not None]


def record_lost_end(w: Writes, failure: AttemptEnd, rec: DecisionRecord,
                    store: StoreSource, tracking=None) -> None:
    """An attempt whose run worker died (known dead on this machine) recorded no end of its
    own: its decider records it where the attempt's step would have (an `attempt_ended`
    observation; MLflow's `attempt_<n>.failure_class`, `last_failure_class`, when
    `tracking`, the MLflow resource, is given), under the name it decided, so that every
    view names it as the decision does. Best-effort, as those records are: the decision is
    made and holds."""
    # Its last step is left unsaid: an orphaned trainer may commit after this look; the
    # lineage counts the attempt's checkpoints.
    ended = replace(failure, last_committed_step=None)
    try:
        w.observe(dg.AssetObservation(
            asset_key=MODEL_CHECKPOINT_KEY, partition=rec.training_run,
            metadata=to_metadata({"event": ATTEMPT_ENDED, **ended.to_dict(),
                                  "recorded_by": "decision"}),
            description=f"attempt {ended.attempt} ended: {ended.outcome.value} (its run "
                        "worker was lost before it recorded the end; recorded by its decision)"))
        repo = run_repo(store, rec.training_run) if tracking is not None else None
        if repo is not None:
            mlrun = MlflowRun(tracking, repo.experiment, rec.training_run, _LOG)
            if mlrun.attach():
                mlrun.on_failure(ended.attempt, rec.failure_class, rec.reason)
                mlrun.finish("KILLED" if rec.kind == Kind.STOPPED_BY_USER.value else "FAILED")
    except Exception:
        _LOG.warning("could not record the end of lost attempt %s of %s", ended.attempt,
                     rec.training_run, exc_info=True)
