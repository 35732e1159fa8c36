"""DagsterRun records in the states the sensors and the lineage report meet them, built in a
(test) instance without running anything."""

from __future__ import annotations

import logging
import time
import uuid

import dagster as dg
from dagster._core.events import DagsterEvent, DagsterEventType
from dagster._core.events.log import EventLogEntry
from dagster._core.remote_origin import (
    RegisteredCodeLocationOrigin,
    RemoteJobOrigin,
    RemoteRepositoryOrigin,
)
from dagster._core.test_utils import create_run_for_test

from ckpt_assets.base.names import PARTITIONS_NAME
from ckpt_assets.base.tags import PARTITION_TAG


def started_run(instance: dg.DagsterInstance, partition: str, started_ago: float = 0.0,
                tags: dict | None = None) -> dg.DagsterRun:
    """A train_job run of `partition` in STARTED, its RUN_START `started_ago` seconds ago."""
    run = create_run_for_test(instance, job_name="train_job",
                              tags={PARTITION_TAG: partition, **(tags or {})})
    instance.handle_new_event(EventLogEntry(
        error_info=None, level=logging.DEBUG, user_message="", run_id=run.run_id,
        timestamp=time.time() - started_ago,
        dagster_event=DagsterEvent(DagsterEventType.RUN_START.value, job_name="train_job")))
    run = instance.get_run_by_id(run.run_id)
    assert run.status == dg.DagsterRunStatus.STARTED
    return run


def lost_worker_run(instance: dg.DagsterInstance, partition: str,
                    tags: dict | None = None) -> dg.DagsterRun:
    """A run whose worker died: marked failed from outside (the reconciler, run monitoring),
    with no STEP_FAILURE and no attempt_ended observation in its event log."""
    run = started_run(instance, partition, tags=tags)
    instance.report_run_failed(run, "run worker lost")
    return instance.get_run_by_id(run.run_id)


def canceled_run(instance: dg.DagsterInstance, partition: str,
                 tags: dict | None = None) -> dg.DagsterRun:
    """A run terminated from Dagster while it ran."""
    run = started_run(instance, partition, tags=tags)
    instance.report_run_canceled(run, "terminated from Dagster")
    return instance.get_run_by_id(run.run_id)


def store_with_a_checkpoint(root, partition: str, max_steps: int, meta: dict | None = None,
                            config: dict | None = None):
    """A CheckpointStore under `root` with `partition` registered (`config`: more keys of
    its config) and step 20 committed by attempt 1 (`meta`: the manifest's extra fields,
    such as the loss)."""
    from ckpt_assets.base.registration import register_training_run
    from ckpt_assets.defs.resources import CheckpointStore
    from trainer.checkpoints.repo import CheckpointRepo

    cs = CheckpointStore(uri=str(root / "store"))
    reg = register_training_run(cs.open(), partition, {"max_steps": max_steps, **(config or {})})
    repo = CheckpointRepo(cs.open(), reg.experiment, partition)
    repo.claim(None, at_least=1)
    pending = repo.begin(20, 1)
    with repo.write_file(pending, "state.pt") as w:
        w.write(b"state at step 20")
    repo.commit(pending, meta or {})
    return cs


def run_in_status(instance: dg.DagsterInstance, partition: str, status: dg.DagsterRunStatus,
                  tags: dict | None = None, job: str = "train_job") -> dg.DagsterRun:
    """A run record of `job` for `partition` in `status` (queued ones included), its
    partition added; no worker behind it."""
    if not instance.has_dynamic_partition(PARTITIONS_NAME, partition):
        instance.add_dynamic_partitions(PARTITIONS_NAME, [partition])
    # Where a launched run comes from (a queued run must say; nothing is loaded from it).
    origin = RemoteJobOrigin(RemoteRepositoryOrigin(
        RegisteredCodeLocationOrigin("ckpt_assets"), "__repository__"), job)
    return instance.add_run(dg.DagsterRun(
        job_name=job, run_id=str(uuid.uuid4()), status=status,
        tags={PARTITION_TAG: partition, **(tags or {})}, remote_job_origin=origin))
