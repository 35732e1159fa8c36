"""The instance `bench_history.py` measures: the project's embedded instance (SQLite) or the
team instance (PostgreSQL), grown through Dagster's public API as a year of training leaves
it (see bench_history.py's doc for what each training run holds)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import dagster as dg
from dagster._core.instance.ref import InstanceRef

from ckpt_assets.base.clock import iso
from ckpt_assets.base.names import PARTITIONS_NAME
from ckpt_assets.base.registration import register_training_run
from ckpt_assets.base.tags import (
    PARTITION_TAG,
    TAG_ATTEMPT,
    TAG_DECIDED_AT,
    TAG_DECISION,
    TAG_DECISION_REASON,
    TAG_FAILURE_CLASS,
    TAG_FAILURE_KIND,
    TAG_PARENT_RUN_ID,
    TAG_RESUMED_BY,
    TAG_ROOT_RUN_ID,
)
from ckpt_assets.defs.resources import CheckpointStore
from ckpt_assets.lifecycle.decision_record import DecisionRecord, create_once
from trainer.checkpoints.repo import CheckpointRepo

ROOT = Path(__file__).resolve().parents[1]
S = dg.DagsterRunStatus


def new_instance(where: Path, postgres=None) -> tuple[dg.DagsterInstance, CheckpointStore, Path]:
    """The project's embedded instance (SQLite), or with `postgres` (a running server) the
    team instance of deploy/postgres/dagster.yaml in a new database on it."""
    home = where / "dagster_home"
    home.mkdir(parents=True)
    if postgres is None:
        shutil.copy(ROOT / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    else:
        from tests.postgres_server import POSTGRES_INSTANCE_YAML

        postgres.create_database("dagster")
        os.environ.update(postgres.instance_env("dagster"))
        shutil.copy(POSTGRES_INSTANCE_YAML, home / "dagster.yaml")
    instance = dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))
    return instance, CheckpointStore(uri=str(where / "store")), home


def add_training_run(instance, key: str, status, tags: dict) -> dg.DagsterRun:
    return instance.add_run(dg.DagsterRun(job_name="train_job", run_id=str(uuid.uuid4()),
                                          status=status, tags={PARTITION_TAG: key, **tags}))


def commit_checkpoint(store, key: str) -> None:
    repo = CheckpointRepo(store, "default", key)
    repo.claim(None, at_least=1)
    pending = repo.begin(20, 1)
    with repo.write_file(pending, "state.pt") as w:
        w.write(b"state at step 20")
    repo.commit(pending, {"loss": 0.5})


def _decided(store, run: dg.DagsterRun, key: str, resume: bool) -> dict[str, str]:
    kind, outcome = ("preempted", "preempted") if resume else ("bug", "user_code_error")
    reason = "preempted: resumed from the latest checkpoint" if resume else "not resumed: a bug"
    now = time.time()
    create_once(store, DecisionRecord(run.run_id, key, resume, kind, outcome, reason, now,
                                      None, "preemptions=1", 1, 20))
    return {TAG_DECISION: "resume" if resume else "stop", TAG_DECISION_REASON: reason,
            TAG_FAILURE_KIND: kind, TAG_FAILURE_CLASS: outcome, TAG_DECIDED_AT: iso(now)}


def grow(instance, cs: CheckpointStore, start: int, stop: int) -> None:
    """Training runs `start`..`stop` - 1, each with its history (see the module's doc)."""
    store = cs.open()
    for i in range(start, stop):
        key = f"h-{i:05d}"
        register_training_run(store, key, {"max_steps": 100})
        commit_checkpoint(store, key)
        turn = i % 10
        if turn <= 7:  # preempted (or terminated), decided `resume`, resumed, finished
            first = dg.DagsterRun(job_name="train_job", run_id=str(uuid.uuid4()),
                                  tags={PARTITION_TAG: key})
            nxt = str(uuid.uuid4())
            ended = S.CANCELED if turn == 7 else S.FAILURE
            failed = instance.add_run(first.with_status(ended).with_tags({
                **first.tags, **_decided(store, first, key, True), TAG_RESUMED_BY: nxt}))
            instance.add_run(dg.DagsterRun(
                job_name="train_job", run_id=nxt, status=S.SUCCESS,
                tags={PARTITION_TAG: key, TAG_PARENT_RUN_ID: failed.run_id,
                      TAG_ROOT_RUN_ID: failed.run_id, TAG_ATTEMPT: "2"}))
        elif turn == 8:  # stopped by the policy
            first = dg.DagsterRun(job_name="train_job", run_id=str(uuid.uuid4()),
                                  tags={PARTITION_TAG: key})
            instance.add_run(first.with_status(S.FAILURE).with_tags({
                **first.tags, **_decided(store, first, key, False)}))
        else:
            add_training_run(instance, key, S.SUCCESS, {})
    keys = [f"h-{i:05d}" for i in range(start, stop)]
    for j in range(0, len(keys), 1000):
        instance.add_dynamic_partitions(PARTITIONS_NAME, keys[j:j + 1000])
