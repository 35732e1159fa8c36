"""Which training runs `ckpt-assets list` shows, found with a few queries whatever the
instance's age.

By default, every run that is open, however old (queued, training, stopping or terminating;
ended and deciding, waiting for a back-off or resuming; registered and never launched), and
the runs that ended most recently, newest first. Open runs are found by what marks them in
Dagster's run storage, never by reading every run: an active run by its status; an ended one
by what did not close it (no decision `stop`, no run resuming it with it as its
`ckpt/parent_run_id`), from run ids and tag values alone; a run never launched by its
partition having no run. Ended runs come from the runs changed most recently, a page at a
time, until enough rows are found: a row's state is read from its partition's newest run, so
a run that was followed by another is passed over there.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import dagster as dg

from ckpt_assets.base.queries import ACTIVE_STATUSES, ENDED_UNSUCCESSFULLY, is_training_run
from ckpt_assets.base.tags import (
    PARTITION_TAG,
    TAG_DECISION,
    TAG_PARENT_RUN_ID,
    TAG_RESUMED_BY,
)

ENDED = (dg.DagsterRunStatus.SUCCESS, *ENDED_UNSUCCESSFULLY)
PAGE = 200
CHUNK = 500  # run ids per query: well under SQLite's bound on a statement's parameters


def _tag_values(instance: dg.DagsterInstance, key: str) -> set[str]:
    return next((values for k, values in instance.get_run_tags(tag_keys=[key]) if k == key),
                set())


def _runs(instance: dg.DagsterInstance, run_ids: list[str]) -> Iterator[dg.DagsterRun]:
    for i in range(0, len(run_ids), CHUNK):
        yield from instance.get_runs(filters=dg.RunsFilter(run_ids=run_ids[i:i + CHUNK]))


def followed(instance: dg.DagsterInstance) -> set[str]:
    """The runs another run took over from (`ckpt/parent_run_id`: a resume, a relaunch):
    none of them is its training run's newest run."""
    return _tag_values(instance, TAG_PARENT_RUN_ID)


def open_partitions(instance: dg.DagsterInstance, partitions: set[str],
                    resumed: set[str]) -> list[str]:
    """The training runs (of `partitions`) that may be open: a training run queued to
    canceling, or ended and not closed (neither decided `stop` nor in `resumed`), or never
    launched. Their state, read from their newest run, says which are."""
    ended = set(instance.get_run_ids(dg.RunsFilter(statuses=list(ENDED_UNSUCCESSFULLY))))
    stopped = set(instance.get_run_ids(dg.RunsFilter(statuses=list(ENDED_UNSUCCESSFULLY),
                                                     tags={TAG_DECISION: "stop"})))
    unclosed = sorted(ended - stopped - resumed)
    active = instance.get_runs(filters=dg.RunsFilter(statuses=list(ACTIVE_STATUSES)))
    found = {r.tags[PARTITION_TAG] for r in (*active, *_runs(instance, unclosed))
             if is_training_run(r) and r.tags[PARTITION_TAG] in partitions}
    never = partitions - _tag_values(instance, PARTITION_TAG)
    return sorted(found | never)


def recently_ended(instance: dg.DagsterInstance, partitions: set[str], resumed: set[str],
                   since: float | None = None) -> Iterator[tuple[str, str]]:
    """(partition, run id) of ended training runs of `partitions`, the most recently changed
    first, back to `since` (epoch seconds; None: all), those in `resumed` left out. A
    partition may come more than once: only its newest run speaks for it."""
    for rec in _by_update_time(instance, since):
        run = rec.dagster_run
        if (run.tags.get(PARTITION_TAG) in partitions and run.run_id not in resumed
                and TAG_RESUMED_BY not in run.tags and is_training_run(run)):
            yield run.tags[PARTITION_TAG], run.run_id


def _by_update_time(instance: dg.DagsterInstance, since: float | None) -> Iterator[dg.RunRecord]:
    """Ended runs, the most recently changed first, a page at a time. Many runs can share
    one update time (a run added with its status gets the database's, to the second), so a
    page ends before its last time, and the runs at that time are read whole."""
    after = None if since is None else datetime.fromtimestamp(since, UTC)
    before = None
    while True:
        recs = instance.get_run_records(
            filters=dg.RunsFilter(statuses=list(ENDED), updated_before=before,
                                  updated_after=after),
            order_by="update_timestamp", limit=PAGE)
        if len(recs) < PAGE:
            yield from recs
            return
        edge = recs[-1].update_timestamp
        yield from (r for r in recs if r.update_timestamp > edge)
        tick = timedelta(microseconds=1)
        yield from instance.get_run_records(filters=dg.RunsFilter(
            statuses=list(ENDED), updated_after=edge - tick, updated_before=edge + tick))
        before = edge
