"""`ckpt-assets list` on an instance with a history: every open run whatever its age, the
runs that ended last up to the limit, a count of the rest, and filters that find the rest.

Runs are records in a real instance (added through its API, in the states `list` meets
them); the store is a real local store.
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime

import dagster as dg
import pytest
from dagster._core.events import DagsterEvent, DagsterEventType

from ckpt_assets.base.clock import iso
from ckpt_assets.base.names import PARTITIONS_NAME
from ckpt_assets.base.tags import (
    TAG_DECISION,
    TAG_DECISION_REASON,
    TAG_PARENT_RUN_ID,
    TAG_RESUME_AT,
)
from ckpt_assets.cli.list_runs import filters_of, parse_since, parse_states, select
from ckpt_assets.defs.resources import CheckpointStore
from tests.dagster_runs import run_in_status, started_run
from trainer.base.errors import ConfigError

S = dg.DagsterRunStatus
ENDED = 60


@pytest.fixture
def instance():
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(uri=str(tmp_path / "store")).open()


def args(*argv: str) -> argparse.Namespace:
    from ckpt_assets.cli.parser import parser

    return parser("").parse_args(["list", *argv])


def history(instance) -> None:
    """Open runs created first, then ENDED runs that ended after them, then one resumed."""
    instance.add_dynamic_partitions(PARTITIONS_NAME, ["old-training"])
    started_run(instance, "old-training")
    run_in_status(instance, "old-waiting", S.FAILURE, tags={
        TAG_DECISION: "resume", TAG_DECISION_REASON: "storage unavailable",
        TAG_RESUME_AT: iso(time.time() + 3600)})
    run_in_status(instance, "old-deciding", S.CANCELED)
    for i in range(ENDED):  # each a second after the one before, an hour ago
        done = run_in_status(instance, f"done-{i:03d}", S.SUCCESS)
        instance.run_storage.handle_run_event(
            done.run_id, DagsterEvent(DagsterEventType.RUN_SUCCESS.value, job_name="train_job"),
            datetime.fromtimestamp(time.time() - 3600 + i, UTC))
    failed = run_in_status(instance, "resumed", S.FAILURE, tags={TAG_DECISION: "resume"})
    run_in_status(instance, "resumed", S.SUCCESS, tags={TAG_PARENT_RUN_ID: failed.run_id})
    run_in_status(instance, "given-up", S.FAILURE, tags={
        TAG_DECISION: "stop", TAG_DECISION_REASON: "not resumed: a bug"})


def listed(instance, store, *argv: str) -> tuple[dict[str, str], int]:
    rows, hidden = select(instance, store, filters_of(args(*argv)))
    return {r["run"]: r["state"] for r in rows}, hidden


def test_old_open_runs_are_listed_whatever_ended_after_them_and_the_ended_stop_at_the_limit(
        instance, store):
    history(instance)
    shown, hidden = listed(instance, store)
    assert {k: v for k, v in shown.items() if k.startswith("old-")} == {
        "old-training": "training", "old-waiting": "waiting for back-off",
        "old-deciding": "deciding"}
    ended = [k for k in shown if not k.startswith("old-")]
    assert len(ended) == 50 and set(ended[:2]) == {"given-up", "resumed"}  # the newest first
    assert ended[2:] == [f"done-{i:03d}" for i in range(ENDED - 1, 11, -1)]
    assert hidden == 3 + ENDED + 2 - len(shown) == 12


def test_the_filters_find_runs_the_default_leaves_out(instance, store):
    history(instance)
    assert listed(instance, store, "--state", "waiting")[0] == {
        "old-waiting": "waiting for back-off"}
    stopped, _ = listed(instance, store, "--state", "stopped", "--state", "training")
    assert stopped == {"given-up": "stopped by policy", "old-training": "training"}
    shown, hidden = listed(instance, store, "--all")
    assert len(shown) == 3 + ENDED + 2 and hidden == 0
    shown, _ = listed(instance, store, "--limit", "3")
    assert len(shown) == 3 + 3
    assert set(listed(instance, store, "--since", "30m")[0]) == {
        "old-training", "old-waiting", "old-deciding", "given-up", "resumed"}
    assert "done-000" in listed(instance, store, "--since", "2h", "--limit", "100")[0]
    future = iso(time.time() + 60)
    assert set(listed(instance, store, "--since", future)[0]) == {
        "old-training", "old-waiting", "old-deciding"}  # open runs, whatever their age


def test_a_listing_reads_no_store_folder_beneath_an_experiment(instance, store, monkeypatch):
    history(instance)

    def recursive(prefix):
        raise AssertionError(f"list({prefix!r}) reads every checkpoint file beneath it")

    monkeypatch.setattr(type(store), "list", lambda self, prefix: recursive(prefix))
    assert len(listed(instance, store)[0]) == 3 + 50


def test_states_and_times_are_named_as_people_write_them_and_anything_else_is_refused():
    assert parse_states(["waiting"]) == {"waiting for back-off"}
    assert parse_states(["stopped"]) == {"stopped by policy", "stopped by user"}
    assert parse_states(["not-launched", "Stopped_By_User"]) == {"not launched",
                                                                 "stopped by user"}
    with pytest.raises(ConfigError, match="is not a state; use one of: not-launched"):
        parse_states(["sleeping"])
    assert parse_since("2h", 10_000.0) == 10_000.0 - 7200
    assert parse_since("2026-12-01", 0) == 1_796_083_200.0
    with pytest.raises(ConfigError, match="neither a duration"):
        parse_since("yesterday", 0)
    with pytest.raises(ConfigError, match="negative"):
        filters_of(args("--limit", "-1"))
