"""The lineage report names every attempt and how it ended, even when the attempt never
reported anything (fast: runs are records in an ephemeral instance, nothing is trained)."""

from __future__ import annotations

import dagster as dg
import pytest
from dagster._core.test_utils import create_run_for_test

from ckpt_assets.lineage import format_lineage, lineage_report
from ckpt_assets.registration import register_training_run
from ckpt_assets.tags import PARTITION_TAG
from tests.dagster_runs import lost_worker_run, started_run
from trainer.storage import open_store

KEY = "lost"


@pytest.fixture
def instance():
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


@pytest.fixture
def store(tmp_path):
    s = open_store(str(tmp_path / "store"))
    register_training_run(s, KEY, {"max_steps": 100})
    return s


def test_a_run_whose_worker_was_lost_is_numbered_by_its_place_and_said_to_be_lost(
        instance, store):
    lost = lost_worker_run(instance, KEY)
    rep = lineage_report(instance, store, KEY)
    (a,) = rep["attempts"]
    assert (a["dagster_run_id"], a["attempt"], a["end"]) == (lost.run_id, 1, "worker_lost")
    assert a["exit_code"] is None
    text = format_lineage(rep)
    assert f"attempt 1: dagster run {lost.run_id} FAILURE" in text
    assert "worker lost" in text and "exit unknown" in text and "attempt ?" not in text


def test_the_attempt_tag_of_a_resume_numbers_it_when_nothing_else_does(instance, store):
    lost_worker_run(instance, KEY)
    resumed = lost_worker_run(instance, KEY, tags={"ckpt/attempt": "5"})
    rep = lineage_report(instance, store, KEY)
    assert [(a["dagster_run_id"], a["attempt"]) for a in rep["attempts"]][1] == (
        resumed.run_id, 5)


def test_a_run_canceled_before_it_started_is_not_called_a_lost_worker(instance, store):
    queued = create_run_for_test(instance, job_name="train_job", tags={PARTITION_TAG: KEY},
                                 status=dg.DagsterRunStatus.NOT_STARTED)
    instance.report_run_canceled(queued, "stopped while queued")
    (a,) = lineage_report(instance, store, KEY)["attempts"]
    assert a["end"] == "not_started"
    assert "before it started" in format_lineage(lineage_report(instance, store, KEY))


def test_a_running_attempt_has_no_end_yet(instance, store):
    started_run(instance, KEY)
    (a,) = lineage_report(instance, store, KEY)["attempts"]
    assert a["end"] is None and a["status"] == "STARTED"
