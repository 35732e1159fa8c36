"""The training run's history on its `model_checkpoint` partition: observations, by kind.

A committed checkpoint is an ASSET_OBSERVATION, not a materialization: a partition is
"Materialized" in Dagster only once a training run finished (the step's output), so a run
whose last attempt failed reads as failed, and one still training as in progress, however
many checkpoints it committed on the way. Each observation's metadata names its kind under
`event`:

* `checkpoint`: a committed checkpoint and its lineage (`ckpt_assets.base.metadata`);
* `attempt_ended`: how an attempt's training process ended (`AttemptEnd`'s fields);
* `state`: the training run's state when it changed (`ckpt_assets.lifecycle.state`); the one
  the resume sensors record when they decide also carries the decision (`failed_run_id`,
  `decision`, `reason`, `failure_kind`, ...; `ckpt_assets.lifecycle.decision.record`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import dagster as dg

MODEL_CHECKPOINT_KEY = dg.AssetKey("model_checkpoint")
CHECKPOINT = "checkpoint"
ATTEMPT_ENDED = "attempt_ended"
STATE = "state"

PAGE = 1000


def partition_events(instance: dg.DagsterInstance, run: str, kind: str | None = None, *,
                     newest_first: bool = False, limit: int | None = None
                     ) -> Iterator[tuple[dict[str, Any], dg.EventLogRecord]]:
    """(metadata values, record) of the partition's observations of one `kind` (all kinds:
    None), oldest first unless `newest_first`; at most `limit` of them."""
    flt = dg.AssetRecordsFilter(asset_key=MODEL_CHECKPOINT_KEY, asset_partitions=[run])
    cursor, found = None, 0
    while True:
        page = instance.fetch_observations(flt, limit=PAGE, cursor=cursor,
                                           ascending=not newest_first)
        for rec in page.records:
            obs = rec.event_log_entry.asset_observation
            md = {k: v.value for k, v in obs.metadata.items()} if obs else {}
            if kind is not None and md.get("event") != kind:
                continue
            yield md, rec
            found += 1
            if limit is not None and found >= limit:
                return
        if not page.has_more:
            return
        cursor = page.cursor


def decisions(instance: dg.DagsterInstance, run: str) -> list[dict[str, Any]]:
    """The resume sensors' decisions on the partition's failed runs, oldest first."""
    return [md for md, _ in partition_events(instance, run, STATE) if md.get("failed_run_id")]


def recorded_checkpoint_names(instance: dg.DagsterInstance, run: str) -> set[str]:
    """Names of the checkpoints the partition's checkpoint observations record."""
    return {str(md["name"]) for md, _ in partition_events(instance, run, CHECKPOINT)
            if md.get("name") is not None}
