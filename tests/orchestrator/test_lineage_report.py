"""The lineage report names every attempt and how it ended, even when the attempt never
reported anything (fast: runs are records in an ephemeral instance, nothing is trained)."""

from __future__ import annotations

import dagster as dg
import pytest
from dagster._core.test_utils import create_run_for_test

from ckpt_assets.base.registration import register_training_run
from ckpt_assets.base.tags import PARTITION_TAG
from ckpt_assets.records.lineage import format_lineage, lineage_report
from tests.dagster_fixtures import *  # noqa: F403 (dagster_home, store_uri)
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


# -- standalone runs: never launched through Dagster, read from the store ------------------

def _standalone(store, experiment: str, run: str) -> list[str]:
    """A script's run: two attempts of CheckpointSession-like commits, no registration."""
    from trainer.checkpoints.repo import CheckpointRepo

    names = []
    for attempt, steps in ((1, (10, 20)), (2, (30,))):
        repo = CheckpointRepo(store, experiment, run)
        repo.claim(names[-1] if names else None, at_least=attempt)
        for step in steps:
            pending = repo.begin(step, attempt)
            with repo.write_file(pending, "model.pt") as f:
                f.write(b"w" * step)
            names.append(repo.commit(pending, {"step": step, "loss": 1.0 / step}).name)
    return names


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    from ckpt_assets.cli.main import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_shows_a_standalone_run_from_the_store_with_its_latest_checkpoint(
        tmp_path, capsys, dagster_home, store_uri):
    import json

    store = open_store(store_uri)
    register_training_run(store, "registered", {"max_steps": 10})
    names = _standalone(store, "default", "script-run")
    _standalone(store, "spirals", "other-exp")
    code, out, err = _cli(capsys, "list", "--json")
    assert code == 0, err
    rows = {r["run"]: r for r in json.loads(out)}
    assert set(rows) == {"script-run"}  # "registered" is no partition yet: not launched
    row = rows["script-run"]
    assert (row["state"], row["experiment"], row["latest_step"], row["attempts"]) == (
        "standalone", "default", 30, 2)
    assert row["latest_checkpoint"].endswith(names[-1])
    code, out, err = _cli(capsys, "list", "--json", "--experiment", "spirals")
    assert {r["run"] for r in json.loads(out)} == {"other-exp"}  # that experiment's alone


def test_lineage_of_a_standalone_run_lists_its_checkpoints_and_attempts(
        tmp_path, capsys, dagster_home, store_uri):
    store = open_store(store_uri)
    names = _standalone(store, "spirals", "script-run")
    code, out, err = _cli(capsys, "lineage", "script-run")
    assert code == 2 and "pass --experiment" in err
    code, out, err = _cli(capsys, "lineage", "script-run", "--experiment", "spirals")
    assert code == 0, err
    assert "standalone: never launched through Dagster" in out
    assert "attempt 1: standalone, 2 checkpoint(s), last committed step 20" in out
    assert "attempt 2: standalone, 1 checkpoint(s), last committed step 30" in out
    for name in names:
        assert name in out
    assert f"{names[-1]} step 30 attempt 2" in out and f"parent {names[1]} <- latest" in out


# -- a CLI re-run after a failure continues the chain -------------------------------------

def test_a_cli_launch_after_a_failure_is_the_next_attempt_linked_to_the_failed_run(
        instance, store):
    from ckpt_assets.base.tags import (
        TAG_ATTEMPT,
        TAG_INTERRUPTED,
        TAG_PARENT_RUN_ID,
        TAG_ROOT_RUN_ID,
    )
    from ckpt_assets.lifecycle.rerun import rerun_tags
    from ckpt_assets.records.listing import run_summary

    assert rerun_tags(instance, KEY) == {}  # nothing to continue
    failed = lost_worker_run(instance, KEY)
    tags = rerun_tags(instance, KEY)
    # The failed attempt joins the chain's interrupted ones by the name its decision gives.
    assert tags == {TAG_PARENT_RUN_ID: failed.run_id, TAG_ROOT_RUN_ID: failed.run_id,
                    TAG_ATTEMPT: "2", TAG_INTERRUPTED: "1:worker_lost"}
    rerun = create_run_for_test(instance, job_name="train_job",
                                tags={PARTITION_TAG: KEY, **tags},
                                status=dg.DagsterRunStatus.STARTED)
    rows = lineage_report(instance, store, KEY)["attempts"]
    assert [(a["dagster_run_id"], a["attempt"], a["parent_run_id"], a["root_run_id"])
            for a in rows] == [(failed.run_id, 1, None, failed.run_id),
                               (rerun.run_id, 2, failed.run_id, failed.run_id)]
    listed = run_summary(instance, store, KEY)
    assert (listed["dagster_run_id"], listed["attempt"]) == (rerun.run_id, 2)
    assert f"continuing run {failed.run_id}" in listed["detail"]
