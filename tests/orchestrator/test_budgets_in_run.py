"""The failure budgets through real trainer processes and real signals, with the shipped
budgets: a run that keeps committing is resumed however often it is killed, and one that
keeps dying without committing is stopped at its budget, in its run and by the sensors."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from ckpt_assets.base.events import ATTEMPT_ENDED, partition_events
from ckpt_assets.base.tags import TAG_BUDGET, TAG_DECISION, TAG_DECISION_REASON
from ckpt_assets.definitions import make_resources
from ckpt_assets.defs.resources import CheckpointStore
from ckpt_assets.lifecycle.decision import due_resume
from ckpt_assets.lifecycle.policy import Budget
from ckpt_assets.lifecycle.settings import Setting
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import (
    materialize_run,
    pointer_step,
    read_heartbeat_pid,
    step_failure_metadata,
    training_config,
)
from tests.polling import WaitTimeout, wait_for

KILLS = 10


@pytest.fixture(autouse=True)
def shipped_policy(monkeypatch):
    for name in Setting:  # the deployment's defaults, whatever this process was given
        monkeypatch.delenv(name, raising=False)


def _ends(instance, key: str) -> list[dict]:
    return [md for md, _ in partition_events(instance, key, ATTEMPT_ENDED)]


class KillAfterEachCommit(threading.Thread):
    """SIGKILLs each new trainer of the run once it has committed a step above the one the
    trainer before it was killed at: every kill comes after new progress."""

    def __init__(self, store_dir, run: str, kills: int):
        super().__init__(daemon=True)
        self.where, self.kills, self.steps = (store_dir, "default", run), kills, []
        self.error: Exception | None = None

    def run(self) -> None:
        last_pid, last_step = None, -1
        try:
            for _ in range(self.kills):
                def new_progress(after: int = last_step, old: int | None = last_pid) -> bool:
                    step, pid = pointer_step(*self.where), read_heartbeat_pid(*self.where)
                    return step is not None and step > after and pid not in (None, old)
                wait_for(new_progress, 300, 0.01, "a new trainer's new checkpoint")
                last_pid, last_step = read_heartbeat_pid(*self.where), pointer_step(*self.where)
                os.kill(last_pid, signal.SIGKILL)
                self.steps.append(last_step)
        except (WaitTimeout, ProcessLookupError) as e:
            self.error = e


@pytest.mark.slow
def test_a_run_killed_ten_times_each_after_new_progress_finishes_with_the_default_budgets(
        instance, tmp_path, mlflow_uri):
    store = tmp_path / "store"
    res = make_resources(str(store), tracking_uri=mlflow_uri)
    killer = KillAfterEachCommit(store, "kept", KILLS)
    killer.start()
    out = materialize_run(instance, "kept", res, training=training_config(
        max_steps=200, checkpoint={"every_steps": 5}, task_args={"step_delay": 0.05}))
    killer.join(5)
    assert killer.error is None and len(killer.steps) == KILLS, (killer.error, killer.steps)
    assert out.success, "ten kills after progress used up no budget"
    ends = _ends(instance, "kept")
    assert [e["failure_class"] for e in ends] == ["killed_by_signal"] * KILLS + ["success"]
    assert [e["attempt"] for e in ends] == list(range(1, KILLS + 2))
    used = Budget.from_tag(instance.get_run_by_id(out.run_id).tags[TAG_BUDGET])
    assert used.failures == KILLS and used.transient == 0 and used.preemptions == 0


@pytest.mark.slow
def test_a_run_that_dies_at_one_step_without_committing_is_stopped_at_its_budget(
        instance, tmp_path, mlflow_uri):
    res = make_resources(str(tmp_path / "store"), tracking_uri=mlflow_uri)
    # Every attempt commits step 10 (or finds it) and is killed before step 15. The run's
    # own back-off is short so that the test waits seconds, not the default 70 s; the
    # budget is the deployment's default.
    out = materialize_run(instance, "loop", res, training=training_config(
        task_args={"crash_at_step": 15}, resume={"backoff_base_seconds": 0.5}))
    assert not out.success
    _, md = step_failure_metadata(out)
    # Attempt 1 advanced (free); attempts 2 to 4 are failures 1 to 3 of 3; attempt 5 is one
    # too many.
    assert md["attempt"] == 5 and md["failure_class"] == "killed_by_signal"
    assert [e["attempt"] for e in _ends(instance, "loop")] == [1, 2, 3, 4, 5]
    run = instance.get_run_by_id(out.run_id)
    assert Budget.from_tag(run.tags[TAG_BUDGET]).transient == 3
    # The sensors, deciding over the same record and budget, stop it too.
    assert due_resume(instance, run, CheckpointStore(uri=str(tmp_path / "store"))) is None
    tags = instance.get_run_by_id(out.run_id).tags
    assert tags[TAG_DECISION] == "stop"
    assert tags[TAG_DECISION_REASON].startswith(
        "not resumed: crash loop, 4 killed failures in a row since step 10, over the budget "
        "of 3; fix the cause")
