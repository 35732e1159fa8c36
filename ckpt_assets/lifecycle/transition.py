"""The one way a training run moves: `transition(instance, partition, event, act)`.

It derives the run's state now (`lifecycle.state`, from its runs: never stored), asks the
lifecycle table for the row of (that state, `event`) (`lifecycle.model.move`: no row, and
`NotAMove` is raised before anything is written), lets the owner act through `Writes`,
and records the row's next state as the partition's state observation. `Writes` is the only
code that writes to a run (its tags, its end, its termination, its decision), and only
`transition` makes one: tests/project/test_write_owners.py fails on a write anywhere else,
and on a `transition` to an event by a module the table does not name as its owner.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

import dagster as dg

from ckpt_assets.base.queries import newest_training_run
from ckpt_assets.base.store import ObjectStore
from ckpt_assets.lifecycle.decision_record import DecisionRecord, create_once
from ckpt_assets.lifecycle.model import Event, State, Transition, move
from ckpt_assets.lifecycle.state import (
    STOPPED,
    RunState,
    run_state,
    state_check_evaluation,
    state_observation,
)

T = TypeVar("T")
# The move being made in this thread: a move made inside it (a stop that ends a run whose
# worker is gone by the lost worker's own move) records the newer state, and the outer none.
_MOVING: ContextVar[Writes | None] = ContextVar("moving", default=None)


class Writes:
    """What an owner may write while it moves a run. Tags it writes are remembered: the
    state recorded after the move reads them even where Dagster's rewrite of an ended run's
    record dropped them for a moment (docs/lifecycle.md)."""

    def __init__(self, instance: dg.DagsterInstance):
        self.instance = instance
        self.tagged: dict[str, dict[str, str]] = {}
        self.moved = True
        self.outrun = False  # a move made inside this one recorded a newer state

    def tag(self, run_id: str, tags: dict[str, str]) -> None:
        self.instance.add_run_tags(run_id, tags)
        self.tagged.setdefault(run_id, {}).update(tags)

    def fail(self, run: dg.DagsterRun, message: str) -> None:
        self.instance.report_run_failed(run, message)

    def canceling(self, run: dg.DagsterRun, message: str) -> None:
        self.instance.report_run_canceling(run, message=message)

    def cancel_queued(self, run: dg.DagsterRun, canceling: str, canceled: str) -> None:
        self.canceling(run, canceling)
        self.instance.report_run_canceled(run, message=canceled)

    def mark_canceled(self, run: dg.DagsterRun, message: str) -> None:
        self.instance.report_run_canceled(run, message=message)

    def terminate_run(self, run_id: str) -> bool:
        return bool(self.instance.run_launcher.terminate(run_id))

    def observe(self, observation: dg.AssetObservation) -> None:
        """An event on the partition from outside its run (a lost attempt's end, recorded
        by its decider where its step would have)."""
        self.instance.report_runless_asset_event(observation)

    def decide(self, store: ObjectStore, rec: DecisionRecord) -> tuple[DecisionRecord, bool]:
        return create_once(store, rec)

    def unmoved(self) -> None:
        """Nothing moved after all (another owner was first): no state is recorded."""
        self.moved = False


@dataclass(frozen=True)
class Moved(Generic[T]):
    row: Transition
    before: RunState
    result: T


def transition(instance: dg.DagsterInstance, partition: str, event: Event,
               act: Callable[[Writes], T] | None = None, *,
               run: dg.DagsterRun | None = None, context: Any = None,
               detail: str | None = None, extra: dict[str, Any] | None = None) -> Moved[T]:
    """Move training run `partition` by `event`: the table's row for its state now, `act`'s
    writes, then the row's next state recorded (with `detail`, else the derived one, and
    `extra` metadata). Raises `NotAMove`, having written nothing, where the table has no row.

    `run`: the Dagster run the event is about, as it stood when the event came (default: the
    partition's newest). `context`: the step's, when the move is made inside the run (its
    observation is then logged by the step)."""
    before = run_state(instance, partition, newest=run)
    row = move(before.state, event)
    writes = Writes(instance)
    outer = _MOVING.get()
    if outer is not None:
        outer.outrun = True
    token = _MOVING.set(writes)
    try:
        result = act(writes) if act is not None else None
    finally:
        _MOVING.reset(token)
    if writes.moved and not writes.outrun:
        _record(instance, partition, row, (run, writes), context, detail, extra)
    return Moved(row, before, result)


def _newest_after(instance: dg.DagsterInstance, partition: str, run: dg.DagsterRun | None,
                  writes: Writes) -> dg.DagsterRun | None:
    """The partition's newest run after the move, as the move left it: Dagster stores a
    run's end before its record says so, and may drop tags written while it rewrites an
    ended run's record (docs/lifecycle.md); both are put back from what the move knew."""
    newest = newest_training_run(instance, partition)
    if newest is None:
        return None
    if run is not None and newest.run_id == run.run_id and run.is_finished \
            and not newest.is_finished:
        newest = newest.with_status(run.status)
    tagged = writes.tagged.get(newest.run_id)
    return newest.with_tags({**newest.tags, **tagged}) if tagged else newest


def _record(instance: dg.DagsterInstance, partition: str, row: Transition,
            made: tuple[dg.DagsterRun | None, Writes], context: Any, detail: str | None,
            extra: dict[str, Any] | None) -> None:
    """The row's next state as the partition's observation (and a state that ends the run as
    its check), from the run as the move (`made`) left it. Best-effort: it is what people
    read, never what a decision rests on."""
    try:
        after = run_state(instance, partition, newest=_newest_after(instance, partition, *made))
        if after.state is not row.next:  # e.g. a terminate its launcher has not acted on yet
            after = replace(after, state=row.next, detail=f"{row.event}")
        state = replace(after, detail=detail) if detail else after
        if context is not None:
            context.log_event(state_observation(state, extra))
            return
        instance.report_runless_asset_event(state_observation(state, extra))
        if state.state in STOPPED or state.state is State.FINISHED:
            instance.report_runless_asset_event(state_check_evaluation(state))
    except Exception:  # an event-log hiccup must not fail a sensor tick or a stop
        # ... but it must not pass unseen: the partition's events then lack this state.
        logging.getLogger(__name__).warning(
            "could not record the state of training run %s", partition, exc_info=True)


def put_back(instance: dg.DagsterInstance, run_id: str, tags: dict[str, str]) -> None:
    """Tags that mirror a record already made (a decision), put back where Dagster's rewrite
    of an ended run dropped them. Not a move: the state they show was recorded when the
    record was made."""
    instance.add_run_tags(run_id, tags)
