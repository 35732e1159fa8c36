"""The ended training runs the reconciler still acts on, found whatever their age, without
reading the instance's history.

An ended run needs the reconciler while it is undecided, or decided `resume` and not yet
resumed. Dagster's run storage cannot select runs by a tag's absence, and the tags that say
"decided" and "resumed" stay on a run for good: a query by them grows with every resumed
preemption, and one capped at the newest N runs forgets an old run that fails late. What
does change when a run needs the reconciler is its record: Dagster sets a run's update time
when it ends, and again when its decision is mirrored on its tags. So the reconciler reads
the ended runs updated since its last look (`updated_after`, a window per question kept in
its cursor) and keeps the back-offs it waits for by run id. Its cost follows the runs that
changed and the back-offs pending; a cursor without a window (the first evaluation, a reset
cursor) reads the whole history once, a page at a time.

A window starts OVERLAP_S before the previous look: an ended run's update time is its end
event's time on the machine that wrote it, and a run worker's clock or a commit in flight can
lag the reconciler's by seconds. A run seen twice is harmless: its decision is created once
and its resume's run_key is launched once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import dagster as dg

from ckpt_assets.base.clock import parse_time
from ckpt_assets.base.queries import ENDED_UNSUCCESSFULLY, is_training_run
from ckpt_assets.base.store import StoreSource
from ckpt_assets.base.view import RunView
from ckpt_assets.lifecycle.decision import resume_or_wait
from ckpt_assets.lifecycle.settings import ResumeSettings

OVERLAP_S = 120.0
PAGE = 500


@dataclass(frozen=True)
class Cursor:
    """The reconciler's cursor: when it last swept, where each window starts, and the
    back-offs it waits for."""

    swept_at: float | None = None  # the last full sweep
    ended_after: float | None = None  # the sweep's window: ended runs updated after this
    # The tick's window: runs ended or decided after this (the name from when a tick read
    # only the runs decided `resume`; kept, as a daemon's stored cursor holds it).
    decided_after: float | None = None
    waiting: tuple[str, ...] = field(default=())  # failed runs whose back-off has not ended

    @classmethod
    def parse(cls, text: str | None) -> Cursor:
        if not text:
            return cls()
        try:
            raw = json.loads(text)
        except ValueError:  # the earlier form: the time of the last sweep alone
            return cls(swept_at=parse_time(text))
        if not isinstance(raw, dict):
            return cls(swept_at=parse_time(str(raw)))
        return cls(raw.get("swept_at"), raw.get("ended_after"), raw.get("decided_after"),
                   tuple(raw.get("waiting") or ()))

    def dump(self) -> str:
        return json.dumps({"swept_at": self.swept_at, "ended_after": self.ended_after,
                           "decided_after": self.decided_after,
                           "waiting": sorted(self.waiting)})


def ended_since(instance: dg.DagsterInstance, after: float | None) -> Iterator[dg.DagsterRun]:
    """Failed or canceled runs updated since OVERLAP_S before `after` (None: all of them),
    newest first, a page at a time."""
    since = None if after is None else datetime.fromtimestamp(after - OVERLAP_S, UTC)
    filters = dg.RunsFilter(statuses=list(ENDED_UNSUCCESSFULLY), updated_after=since)
    cursor = None
    while True:
        page = instance.get_runs(filters=filters, cursor=cursor, limit=PAGE)
        yield from page
        if len(page) < PAGE:
            return
        cursor = page[-1].run_id


def needs_reconciler(run: dg.DagsterRun) -> bool:
    """Whether an ended run, as its tags say, may still need a decision or a resume: a
    training run undecided, or decided `resume` and neither resumed nor withdrawn. (Tags
    only narrow the search: the decision's record in the store is what is acted on.)"""
    if not is_training_run(run):
        return False
    view = RunView.of(run)
    return view.decision is None or (view.decision == "resume" and not view.resumed_by
                                     and not view.stop_requested)


@dataclass
class Found:
    """What one look found: the resumes due now, and the back-offs still to wait for."""

    requests: list[dg.RunRequest] = field(default_factory=list)
    waiting: set[str] = field(default_factory=set)
    tracking: Any = None  # the MLflow resource: a lost attempt's end (record_lost_end)

    def act_on(self, instance: dg.DagsterInstance, runs: Iterator[dg.DagsterRun],
               store: StoreSource, settings: ResumeSettings, now: float) -> None:
        for run in runs:
            if not needs_reconciler(run):
                continue
            due = RunView.of(run).resume_at
            if due is not None and now < due:  # by its tag, without reading the store
                self.waiting.add(run.run_id)
                continue
            out = resume_or_wait(instance, run, store, settings, now, self.tracking)
            if isinstance(out, dg.RunRequest):
                self.requests.append(out)
                self.waiting.discard(run.run_id)
            elif out is not None:
                self.waiting.add(run.run_id)


def _look(instance: dg.DagsterInstance, window: Iterator[dg.DagsterRun], cursor: Cursor,
          store: StoreSource, settings: ResumeSettings, now: float, tracking=None) -> Found:
    """Act on the runs of a window and on the back-offs the cursor waits for."""
    runs = {r.run_id: r for r in window}
    others = [i for i in cursor.waiting if i not in runs]
    if others:
        runs.update((r.run_id, r) for r in instance.get_runs(
            filters=dg.RunsFilter(run_ids=others)))
    found = Found(tracking=tracking)
    found.act_on(instance, iter(runs.values()), store, settings, now)
    return found


def due_resumes(instance: dg.DagsterInstance, store: StoreSource, settings: ResumeSettings,
                now: float, cursor: Cursor, tracking=None) -> tuple[Found, Cursor]:
    """The reconciler's every tick: the runs ended or decided since its last tick, and the
    back-offs it waits for; each one undecided is decided now (the failure sensors, evaluated
    in the same daemon loop, may decide it first: the decision is created once), and each
    resume that is due is requested. A failure is so resumed in the loop after it, not a loop
    later, after a failure sensor's decision. The window is read by status and update time
    alone (Dagster indexes both together); what needs the reconciler is told by the tags."""
    found = _look(instance, ended_since(instance, cursor.decided_after), cursor, store,
                  settings, now, tracking)
    return found, replace(cursor, decided_after=now, waiting=tuple(sorted(found.waiting)))


def sweep_ended(instance: dg.DagsterInstance, store: StoreSource, settings: ResumeSettings,
                now: float, cursor: Cursor, tracking=None) -> tuple[Found, Cursor]:
    """The full sweep's share of ended runs: every ended run updated since the last sweep
    (how the failure sensors' misses are found, whatever the run's age), decided if it is
    not, and resumed once due; and the back-offs it waits for. The sweep's window holds the
    tick's (it starts earlier), so it is the one query for both."""
    found = _look(instance, ended_since(instance, cursor.ended_after), cursor, store,
                  settings, now, tracking)
    return found, replace(cursor, swept_at=now, ended_after=now, decided_after=now,
                          waiting=tuple(sorted(found.waiting)))
