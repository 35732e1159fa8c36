"""Which Dagster runs are training runs, and a partition's newest and active ones.

A partition's runs are its training runs (attempts, each a chain link) and its check runs;
everything that counts attempts or reads a run's state asks here.
"""

from __future__ import annotations

import dagster as dg

from ckpt_assets.base.events import MODEL_CHECKPOINT_KEY
from ckpt_assets.base.names import TRAINING_JOB_NAMES
from ckpt_assets.base.tags import PARTITION_TAG


def is_training_run(run: dg.DagsterRun) -> bool:
    """A run of a training job, or an ad hoc run that trains model_checkpoint (the UI's
    Materialize, `dagster asset materialize`, `materialize()`: Dagster's hidden asset jobs,
    whose runs name no selection, or an empty one, when they materialize all their assets)."""
    if PARTITION_TAG not in run.tags:
        return False
    if run.job_name in TRAINING_JOB_NAMES:
        return True
    if not run.asset_selection:
        # ... but not a run of checks alone (the UI's "Execute" on a check).
        return run.job_name.startswith("__") and not run.asset_check_selection
    return MODEL_CHECKPOINT_KEY in run.asset_selection


def training_runs_of(instance: dg.DagsterInstance, partition: str) -> list[dg.DagsterRun]:
    """The partition's training runs, newest first (its check runs left out)."""
    runs = instance.get_runs(filters=dg.RunsFilter(tags={PARTITION_TAG: partition}))
    return [r for r in runs if is_training_run(r)]


def newest_training_run(instance: dg.DagsterInstance, partition: str) -> dg.DagsterRun | None:
    # A training run is followed by at most one check run: a few runs always reach it.
    for run in instance.get_runs(filters=dg.RunsFilter(tags={PARTITION_TAG: partition}),
                                 limit=20):
        if is_training_run(run):
            return run
    return None


def newest_training_runs(instance: dg.DagsterInstance,
                         partitions: list[str]) -> dict[str, dg.DagsterRun]:
    """Each partition's newest training run, read in one query for all of them (a partition
    without one is left out)."""
    newest: dict[str, dg.DagsterRun] = {}
    if partitions:
        for run in instance.get_runs(filters=dg.RunsFilter(tags={PARTITION_TAG: partitions})):
            if run.tags[PARTITION_TAG] not in newest and is_training_run(run):
                newest[run.tags[PARTITION_TAG]] = run
    return newest


ACTIVE_STATUSES = (dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED,
                   dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED,
                   dg.DagsterRunStatus.CANCELING)
ENDED_UNSUCCESSFULLY = (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)


def active_runs(instance: dg.DagsterInstance, partition: str) -> list[dg.DagsterRun]:
    """Training runs of the partition that are queued, starting, running or canceling (its
    check runs are not training: nothing to stop, nothing that blocks a launch)."""
    runs = instance.get_runs(filters=dg.RunsFilter(tags={PARTITION_TAG: partition},
                                                   statuses=list(ACTIVE_STATUSES)))
    return [r for r in runs if is_training_run(r)]
