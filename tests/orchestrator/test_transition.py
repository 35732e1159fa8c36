"""A training run moves only through `transition`: its state derived, the table's row taken
(no row: nothing written, not even what the owner meant to), the owner's writes made, and
the row's next state recorded on the partition. Fast: runs are records in an ephemeral
instance, nothing trains."""

from __future__ import annotations

import dagster as dg
import pytest

from ckpt_assets.base.events import STATE, partition_events
from ckpt_assets.base.tags import TAG_NO_RESUME
from ckpt_assets.lifecycle.model import Event, NotAMove, State
from ckpt_assets.lifecycle.transition import transition
from tests import dagster_runs

KEY = "moved"
S = dg.DagsterRunStatus


@pytest.fixture
def instance():
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def recorded(instance) -> list[str]:
    return [md["state"] for md, _ in partition_events(instance, KEY, STATE)]


def test_an_event_the_table_has_no_row_for_raises_before_the_owner_writes_anything(instance):
    run = dagster_runs.run_in_status(instance, KEY, S.SUCCESS)
    acted = []
    with pytest.raises(NotAMove, match="a run that is finished cannot be moved by"):
        transition(instance, KEY, Event.STOP_REQUESTED, acted.append)
    assert acted == [] and recorded(instance) == []
    assert TAG_NO_RESUME not in instance.get_run_by_id(run.run_id).tags


def test_a_move_makes_the_owners_writes_and_records_the_rows_next_state(instance):
    run = dagster_runs.run_in_status(instance, KEY, S.STARTED)
    moved = transition(instance, KEY, Event.STOP_REQUESTED,
                       lambda w: w.tag(run.run_id, {TAG_NO_RESUME: "true"}))
    assert (moved.before.state, moved.row.next) == (State.TRAINING, State.STOPPING)
    assert instance.get_run_by_id(run.run_id).tags[TAG_NO_RESUME] == "true"
    assert recorded(instance) == ["stopping"]


def test_an_owner_that_finds_the_move_made_already_records_no_state(instance):
    dagster_runs.run_in_status(instance, KEY, S.FAILURE)
    moved = transition(instance, KEY, Event.DECIDED_RESUME, lambda w: w.unmoved())
    assert moved.row.next is State.RESUMING and recorded(instance) == []


def test_the_state_is_derived_from_the_run_as_the_event_found_it(instance):
    # A decider sees the run's end event before Dagster's record of the run says it ended.
    run = dagster_runs.run_in_status(instance, KEY, S.STARTED)
    with pytest.raises(NotAMove):
        transition(instance, KEY, Event.DECIDED_STOP)
    moved = transition(instance, KEY, Event.DECIDED_STOP, run=run.with_status(S.FAILURE))
    assert moved.before.state is State.DECIDING
