"""Nothing committed is lost from Dagster's lineage: a checkpoint that an attempt committed
after its orchestrator died (nobody read its report) is materialized, late, by the next
attempt, and the lineage report names the lost attempt and how it ended.

The lost attempt is built as it happens in production, minus the kill: a Dagster run of
the partition that ended FAILURE without any step event (its run worker died), and a
command process with that run's environment that committed step 20 to the store and whose
report nobody read.
"""

from __future__ import annotations

import subprocess

import dagster as dg
import pytest

from ckpt_assets.base.datasets import describe_dataset
from ckpt_assets.base.names import PARTITIONS_NAME
from ckpt_assets.base.registration import register_training_run
from ckpt_assets.definitions import make_resources
from ckpt_assets.records.lineage import format_lineage, lineage_report
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import PYTHON, ROOT, checkpoints, materialize_run
from tests.dagster_runs import lost_worker_run
from trainer.process.contract import LaunchEnv
from trainer.storage import open_store

pytestmark = pytest.mark.slow

KEY = "orphaned"
PLAIN = str(ROOT / "examples" / "plain_script" / "train.py")
ORPHAN = "step-000000020-a1"


def _commit_as_lost_attempt(store: str, reg, dead_run_id: str, steps: int) -> None:
    """What the trainer of attempt 1 did after its run worker was SIGKILLed: commit."""
    dataset, _ = describe_dataset(reg)
    told = LaunchEnv(reg.run, reg.experiment, store, attempt=1, dagster_run_id=dead_run_id,
                     root_run_id=dead_run_id, dataset_uri=dataset.uri or None,
                     data_version=dataset.version, exit_with_parent=False)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **told.to_env()}
    proc = subprocess.run([PYTHON, PLAIN, "--steps", str(steps)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def lost_then_resumed(tmp_path_factory, shared_mlflow_db):
    base = tmp_path_factory.mktemp("late")
    store = str(base / "store")
    cfg = {"command": ["python", PLAIN, "--steps", "60"], "max_steps": 60}
    with dg.DagsterInstance.ephemeral() as instance:
        reg = register_training_run(open_store(store), KEY, cfg)
        instance.add_dynamic_partitions(PARTITIONS_NAME, [KEY])
        dead = lost_worker_run(instance, KEY)
        _commit_as_lost_attempt(store, reg, dead.run_id, steps=20)
        resources = make_resources(store, tracking_uri=shared_mlflow_db)
        second = materialize_run(instance, KEY, resources)
        third = materialize_run(instance, KEY, resources)
        report = lineage_report(instance, open_store(store), KEY)
        yield {"dead": dead, "second": second, "third": third, "report": report}


def test_a_checkpoint_committed_after_its_orchestrator_died_is_recorded_late_by_the_next_attempt(
        lost_then_resumed):
    second = lost_then_resumed["second"]
    assert second.success
    late, *reported = checkpoints(second)
    assert late["name"] == ORPHAN and late["step"] == 20 and late["attempt"] == 1
    assert late["recorded_late"] is True
    assert late["dagster_run_id"] == lost_then_resumed["dead"].run_id
    assert late["recorded_by_run_id"] == second.run_id
    assert not any(m.get("recorded_late") for m in reported)
    # The first checkpoint the next attempt reports now links to a recorded parent.
    assert reported[0]["parent"] == ORPHAN and reported[0]["attempt"] == 2


def test_the_late_record_says_which_attempt_committed_it_and_that_its_orchestrator_died(
        lost_then_resumed):
    second = lost_then_resumed["second"]
    (desc,) = [obs.description for obs in (
        ev.event_specific_data.asset_observation for ev in second.all_events
        if ev.event_type_value == "ASSET_OBSERVATION") if obs.metadata.get("recorded_late")]
    assert "committed by attempt 1" in desc and "orchestrator died" in desc
    assert lost_then_resumed["dead"].run_id in desc


def test_a_checkpoint_dagster_has_already_recorded_is_not_recorded_again(lost_then_resumed):
    third = lost_then_resumed["third"]
    assert third.success
    assert not any(m.get("recorded_late") for m in checkpoints(third))


def test_the_lineage_report_numbers_the_lost_attempt_and_says_its_worker_was_lost(
        lost_then_resumed):
    rep = lost_then_resumed["report"]
    dead = lost_then_resumed["dead"]
    lost = rep["attempts"][0]
    assert lost["dagster_run_id"] == dead.run_id
    assert lost["attempt"] == 1 and lost["end"] == "worker_lost"
    assert lost["exit_code"] is None and lost["last_committed_step"] == 20
    assert [a["attempt"] for a in rep["attempts"]] == [1, 2, 3]
    (row,) = [c for c in rep["checkpoints"] if c["name"] == ORPHAN]
    assert row["recorded_late"] is True and row["dagster_run_id"] == dead.run_id
    text = format_lineage(rep)
    assert "attempt ?" not in text
    assert f"attempt 1: dagster run {dead.run_id} FAILURE" in text
    assert "worker lost" in text and "exit unknown" in text
    assert f"{ORPHAN} step 20 attempt 1" in text and "recorded late" in text
