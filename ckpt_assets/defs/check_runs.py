"""Runs the asset checks of a training run once, after the training run succeeded.

The checks (ckpt_assets.defs.checks) are not planned inside the training jobs: an interrupted
attempt (preemption, exit 143) ends as a failed Dagster run, and every check planned in it
would be recorded as "execution failed" although nothing was checked. Instead
`check_succeeded_training` watches for training runs that succeed and launches
`check_training_run` for the run's partition: one run per succeeded training run
(`run_key` `checks-<training run id>`), whose evaluations are recorded on the partition.

A check run carries the partition's `dagster/partition` tag, as any partitioned run does:
it shares the run queue's one-active-run-per-partition limit with the training runs, so the
checks never read a partition that a training run is writing.
"""

from __future__ import annotations

import dagster as dg

from ckpt_assets.base.queries import is_training_run, newest_training_run
from ckpt_assets.base.tags import PARTITION_TAG, TAG_CHECKED_RUN
from ckpt_assets.defs.checks import TRAINING_CHECKS
from ckpt_assets.defs.jobs import check_training_run
from ckpt_assets.defs.sensors import TICK_S

CHECKS_KEY_PREFIX = "checks-"


def _checks_to_run(instance: dg.DagsterInstance, run: dg.DagsterRun) -> list[dg.AssetCheckKey]:
    """The checks of the assets `run` materialized, less those it evaluated itself (a run
    launched together with its checks, e.g. the UI's Materialize of the assets)."""
    materialized = run.asset_selection or None  # None or empty: the whole training job
    done = {rec.dagster_event.event_specific_data.asset_check_key
            for rec in instance.all_logs(run.run_id,
                                         of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)}
    return [key for checks in TRAINING_CHECKS for key in checks.check_keys
            if (materialized is None or key.asset_key in materialized) and key not in done]


def checks_request(instance: dg.DagsterInstance,
                   run: dg.DagsterRun) -> dg.RunRequest | dg.SkipReason:
    """The check run for a training run that succeeded, or why there is none."""
    if not is_training_run(run):
        return dg.SkipReason(f"run {run.run_id[:8]} ({run.job_name}) is not a training run")
    partition = run.tags[PARTITION_TAG]
    keys = _checks_to_run(instance, run)
    if not keys:
        return dg.SkipReason(f"run {run.run_id[:8]} of {partition} evaluated its checks itself "
                             "or materialized no checked asset")
    newer = newest_training_run(instance, partition)
    if newer is not None and newer.run_id != run.run_id:
        # The checks read the partition's current state (latest.json, the current model),
        # which now belongs to the newer run; its own success runs them.
        return dg.SkipReason(f"run {run.run_id[:8]} of {partition}: a newer training run "
                             f"({newer.run_id[:8]}, {newer.status.value}) exists; the checks "
                             "run when that one succeeds")
    every = len(keys) == sum(len(c.check_keys) for c in TRAINING_CHECKS)
    return dg.RunRequest(
        run_key=f"{CHECKS_KEY_PREFIX}{run.run_id}",
        job_name=check_training_run.name,
        # The job has no partitions definition of its own (a checks-only asset job in
        # Dagster 1.13 takes none): the tag is the partition, as Dagster's own
        # partitioned runs carry it, and the partitioned checks evaluate on it.
        partition_key=partition,
        tags={PARTITION_TAG: partition, TAG_CHECKED_RUN: run.run_id},
        asset_check_keys=None if every else keys,
    )


@dg.run_status_sensor(
    name="check_succeeded_training",
    run_status=dg.DagsterRunStatus.SUCCESS,
    request_job=check_training_run,
    minimum_interval_seconds=TICK_S,
    default_status=dg.DefaultSensorStatus.RUNNING,
    description="Runs the asset checks of a training run once it succeeded, on its partition "
                "(check_training_run, one run per succeeded training run).",
)
def check_succeeded_training(context: dg.RunStatusSensorContext):
    got = checks_request(context.instance, context.dagster_run)
    if isinstance(got, dg.RunRequest):
        context.log.info(f"checking {got.partition_key} after run {context.dagster_run.run_id}")
    return got


CHECK_SENSORS = [check_succeeded_training]
