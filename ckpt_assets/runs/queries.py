"""Which Dagster runs are training runs, the newest one of a partition, and run tags that
stick when another process writes the run's tags at the same moment.

A partition's runs are its training runs (attempts, each a chain link) and its check runs;
everything that counts attempts or reads a run's state asks here.
"""

from __future__ import annotations

import time

import dagster as dg

from ckpt_assets.runs.events import MODEL_CHECKPOINT_KEY
from ckpt_assets.runs.names import TRAINING_JOB_NAMES
from ckpt_assets.runs.tags import PARTITION_TAG


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


TAGS_SETTLE_S = 0.5  # longer than another process's tag write takes from its read to its write
TAGS_TRIES = 4


def add_tags_that_stick(instance: dg.DagsterInstance, run_id: str, tags: dict[str, str],
                        settle_s: float = TAGS_SETTLE_S) -> None:
    """`instance.add_run_tags`, written again until it holds. Dagster merges tags into the
    run's stored record by reading the record and writing it back whole, so another
    process's tag write that read the run just before this one puts the old values back
    over ours (seen: the run worker, recording its ended processes, reverted the
    reconciler's account of how it retired the trainer). For a writer that races one by
    design; each try waits `settle_s` before it looks."""
    for _ in range(TAGS_TRIES):
        instance.add_run_tags(run_id, tags)
        time.sleep(settle_s)
        run = instance.get_run_by_id(run_id)
        if run is None or all(run.tags.get(k) == v for k, v in tags.items()):
            return
