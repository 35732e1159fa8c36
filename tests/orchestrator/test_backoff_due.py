"""A back-off ends when it is due: the reconciler ticks every 5 s and launches due back-offs
on every tick, while its full sweep (every ended run, every trainer's heartbeat) runs at
most every 15 s."""

from __future__ import annotations

import json
import time

import dagster as dg

from ckpt_assets.base.clock import iso
from ckpt_assets.base.tags import TAG_BUDGET, TAG_DECISION
from ckpt_assets.defs.sensors import RECONCILE_EVERY_S, reconcile_training_runs
from tests.dagster_fixtures import NO_MLFLOW
from tests.orchestrator import test_sensors
from tests.orchestrator.test_sensors import (
    backdate_decision,
    beat,
    failed_run,
    on_failure,
    started_run,
    tags_of,
)

# The sensors' tests' fixtures: a fresh instance, the run's store, the shipped settings.
instance, store, timeouts = test_sensors.instance, test_sensors.store, test_sensors.timeouts


def tick(instance, store, cursor: str | None) -> list[dg.RunRequest]:
    out = reconcile_training_runs(dg.build_sensor_context(
        instance=instance, resources={"checkpoint_store": store, **NO_MLFLOW}, cursor=cursor))
    return [] if isinstance(out, dg.SkipReason) else list(out)


def _backed_off_run(instance, store, monkeypatch):
    monkeypatch.setenv("CKPT_BACKOFF_BASE_S", "30")
    # Again at step 20 (failed_run's), the step the run had reached: no progress, a back-off.
    budget = {"transient": 0, "resumed_from_step": 20, "high_step": 20, "failures": 1}
    run = failed_run(instance, exit_code=5, failure_class="storage_unavailable",
                     tags={TAG_BUDGET: json.dumps(budget)})
    assert isinstance(on_failure(instance, run, store), dg.SkipReason)  # a 30 s back-off
    assert tags_of(instance, run)[TAG_DECISION] == "resume"
    return run


def test_a_due_back_off_is_launched_at_the_next_tick_between_full_sweeps(
        instance, store, monkeypatch):
    run = _backed_off_run(instance, store, monkeypatch)
    just_swept = iso(time.time())
    assert tick(instance, store, just_swept) == []  # not due yet
    backdate_decision(instance, run, 31, store)
    (req,) = tick(instance, store, just_swept)
    assert req.run_key == f"resume-{run.run_id}"


def test_the_full_sweep_runs_only_once_its_interval_has_passed(instance, store):
    run = started_run(instance, started_ago=3600)
    beat(store, age_s=3600)  # a dead trainer: only the full sweep judges heartbeats
    tick(instance, store, iso(time.time()))
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED
    tick(instance, store, iso(time.time() - RECONCILE_EVERY_S - 1))
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
