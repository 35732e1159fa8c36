"""The lifecycle table is the one account of who moves a training run from state to state."""

from __future__ import annotations

from pathlib import Path

from ckpt_assets.lifecycle.model import TABLE, Event, State, allows, table_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_docs_lifecycle_page_holds_the_table_the_code_uses():
    text = (ROOT / "docs" / "lifecycle.md").read_text()
    between = text.split("<!-- lifecycle -->", 1)[1].split("<!-- /lifecycle -->", 1)[0]
    assert between.strip() == table_markdown()


def test_every_owner_in_the_table_is_a_module_of_ckpt_assets():
    missing = {t.owner for t in TABLE
               if not (ROOT / "ckpt_assets" / (t.owner.replace(".", "/") + ".py")).exists()}
    assert missing == set()


def test_one_owner_per_state_and_event_and_every_state_is_reached_and_left():
    keys = [(t.state, t.event) for t in TABLE]
    assert len(keys) == len(set(keys))
    reached = {t.next for t in TABLE} | {State.NOT_LAUNCHED}
    assert reached == set(State)
    left = {t.state for t in TABLE}
    assert left == set(State) - {State.FINISHED}  # a finished run is done


def test_a_finished_run_cannot_be_launched_again_and_a_training_one_is_not_decided():
    assert not allows(State.FINISHED, Event.LAUNCHED)
    assert not allows(State.TRAINING, Event.DECIDED_RESUME)
    assert allows(State.DECIDING, Event.DECIDED_STOP)
    assert {t.event for t in TABLE} == set(Event)


def test_an_owner_moves_a_run_only_by_a_row_and_records_the_rows_next_state():
    import pytest

    from ckpt_assets.lifecycle.model import NotAMove, move

    assert move(State.TRAINING, Event.RELAUNCHED_IN_RUN).next is State.TRAINING
    assert move(State.TRAINING, Event.TERMINATED).next is State.TERMINATING
    assert move(State.TERMINATING, Event.ATTEMPT_ENDED).next is State.DECIDING
    with pytest.raises(NotAMove, match="a run that is finished cannot be moved by"):
        move(State.FINISHED, Event.LAUNCHED)
