"""The reconciler on an instance with a history: an old run that fails late, and a back-off
decided long ago, are found however many runs ended after them; a look at an instance whose
runs all ended long ago, decided, reads none of them.

The history is built through the instance's API, as a busy instance holds it: training runs
of other partitions that failed or were canceled, each decided `resume` and resumed, their
records last changed an hour ago. The reconciler is evaluated through Dagster's own sensor
context, its cursor carried from one evaluation to the next as the daemon carries it.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from types import SimpleNamespace

import dagster as dg
import pytest
from dagster._core.events import DagsterEvent, DagsterEventType
from dagster._core.test_utils import create_run_for_test

from ckpt_assets.base.tags import (
    PARTITION_TAG,
    TAG_BUDGET,
    TAG_DECISION,
    TAG_RESUMED_BY,
)
from ckpt_assets.defs import sensors
from ckpt_assets.defs.sensors import RECONCILE_EVERY_S, reconcile_training_runs
from tests.dagster_fixtures import NO_MLFLOW
from tests.orchestrator import test_sensors
from tests.orchestrator.test_sensors import (
    KEY,
    _evaluate,
    backdate_decision,
    failed_run,
    launched,
    started_run,
    tags_of,
)

# The sensors' tests' fixtures: a fresh instance, the run's store, the shipped settings.
instance, store, timeouts = test_sensors.instance, test_sensors.store, test_sensors.timeouts

# More than the 200 newest failed or canceled runs an earlier reconciler looked at.
NEWER = 230
LONG_AGO_S = 3600.0


def restamp(instance, run: dg.DagsterRun, ago_s: float) -> None:
    """Make the run's record last changed `ago_s` seconds ago, as its end was written then."""
    status = instance.get_run_by_id(run.run_id).status
    kind = (DagsterEventType.RUN_CANCELED if status == dg.DagsterRunStatus.CANCELED
            else DagsterEventType.RUN_FAILURE)
    instance.run_storage.handle_run_event(
        run.run_id, DagsterEvent(kind.value, job_name=run.job_name),
        datetime.fromtimestamp(time.time() - ago_s, UTC))


def history(instance, n: int = NEWER) -> None:
    """`n` training runs of other partitions, created after everything before and failed or
    canceled, each decided `resume` and resumed, their records last changed long ago."""
    for i in range(n):
        run = create_run_for_test(instance, job_name="train_job", tags={
            PARTITION_TAG: f"other-{i:04d}", TAG_DECISION: "resume", TAG_RESUMED_BY: "next"})
        if i % 3:
            instance.report_run_failed(run, "preempted")
        else:
            instance.report_run_canceled(run, "terminated from Dagster")
        restamp(instance, run, LONG_AGO_S)


def reconcile(instance, store, cursor: str | None,
              ahead_s: float = 0.0) -> tuple[list[dg.RunRequest], str | None]:
    """One evaluation of the reconciler `ahead_s` seconds from now: its run requests, and
    the cursor it leaves for the next evaluation."""
    ctx = dg.build_sensor_context(instance=instance, cursor=cursor,
                                  resources={"checkpoint_store": store, **NO_MLFLOW})
    clock = SimpleNamespace(time=lambda: time.time() + ahead_s)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sensors, "time", clock)
        out = reconcile_training_runs(ctx)
    return ([] if isinstance(out, dg.SkipReason) else list(out)), ctx.cursor


def later_sweep(instance, store, cursor: str | None) -> list[dg.RunRequest]:
    """The reconciler's next full sweep, once its interval has passed."""
    return reconcile(instance, store, cursor, ahead_s=RECONCILE_EVERY_S + 1)[0]


def test_an_old_run_failing_undecided_after_hundreds_of_newer_runs_ended_is_decided_and_resumed(
        instance, store):
    old = started_run(instance)  # created first: a long training run
    history(instance)  # then many more runs failed or were canceled
    _, cursor = reconcile(instance, store, None)  # the reconciler has been running all along
    instance.report_run_failed(old, "run worker lost")  # the old run fails; no sensor saw it
    (req,) = later_sweep(instance, store, cursor)
    assert req.run_key == f"resume-{old.run_id}" and req.partition_key == KEY
    assert tags_of(instance, old)[TAG_DECISION] == "resume"
    launched(instance, req)
    assert later_sweep(instance, store, cursor) == []


def test_a_back_off_decided_before_hundreds_of_newer_resumes_is_launched_once_due(
        instance, store, monkeypatch):
    monkeypatch.setenv("CKPT_BACKOFF_BASE_S", "30")
    # Again at step 20 (failed_run's), the step the run had reached: a 30 s back-off.
    budget = {"transient": 0, "resumed_from_step": 20, "high_step": 20, "failures": 1}
    old = failed_run(instance, exit_code=5, failure_class="storage_unavailable",
                     tags={TAG_BUDGET: json.dumps(budget)})
    assert isinstance(_evaluate(sensors.resume_failed_training, instance, old, store),
                      dg.SkipReason)
    assert tags_of(instance, old)[TAG_DECISION] == "resume"
    reqs, cursor = reconcile(instance, store, None)
    assert reqs == []  # not due yet
    history(instance)  # hundreds of newer runs decided `resume`
    backdate_decision(instance, old, 31, store)  # the back-off is over ...
    restamp(instance, old, LONG_AGO_S)  # ... and the old run's record changed long ago
    (req,) = reconcile(instance, store, cursor)[0]  # the next tick, not a sweep
    assert req.run_key == f"resume-{old.run_id}"


def counting(instance, monkeypatch) -> list[int]:
    """How many runs each of the instance's run queries returned, from now on."""
    loaded: list[int] = []
    for name in ("get_runs", "get_run_records"):
        real = getattr(instance, name)

        def query(*args, _real=real, **kwargs):
            out = _real(*args, **kwargs)
            loaded.append(len(out))
            return out

        monkeypatch.setattr(instance, name, query)
    return loaded


def test_a_sweep_and_a_tick_of_an_instance_whose_runs_all_ended_long_ago_read_none_of_them(
        instance, store, monkeypatch):
    history(instance)
    reqs, cursor = reconcile(instance, store, None)  # the first look reads the history once
    assert reqs == []
    loaded = counting(instance, monkeypatch)
    assert later_sweep(instance, store, cursor) == []
    assert sum(loaded) == 0 and len(loaded) <= 3, loaded
    loaded.clear()
    assert reconcile(instance, store, cursor)[0] == []
    assert sum(loaded) == 0 and len(loaded) <= 2, loaded
