"""`ckpt-assets list`: the training runs a person looks for first, and filters for the rest.

By default every open run, whatever its age (queued, training, stopping, terminating,
deciding, waiting for back-off, resuming, not launched), then the runs that ended most
recently (finished, stopped by policy, stopped by user), newest first, at most `--limit`
(50) of them; then standalone runs (only in the store) of the searched experiments, as many.
A last line counts the runs not shown. `--state`, `--experiment` and `--since` filter;
`--all` lifts the limit (and reads every run: seconds on an instance of thousands).
Which runs are found, and how cheaply: `ckpt_assets.records.selection`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import dagster as dg

from ckpt_assets.base.names import PARTITIONS_NAME
from ckpt_assets.base.queries import newest_training_runs
from ckpt_assets.lifecycle.model import State
from ckpt_assets.records.listing import (
    DEFAULT_EXPERIMENT,
    STANDALONE,
    run_summary,
    standalone_runs,
    standalone_summary,
)
from ckpt_assets.records.selection import followed, open_partitions, recently_ended
from trainer.base.errors import ConfigError
from trainer.storage import ObjectStore, validate_name

DEFAULT_LIMIT = 50
BATCH = 50  # rows whose newest runs are read in one query
CLOSED = frozenset({State.FINISHED, State.STOPPED_BY_POLICY, State.STOPPED_BY_USER})
STATES = [*(s.value for s in State), STANDALONE]
_UNITS = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_states(words: list[str]) -> set[str] | None:
    """The states `--state` names (a state, or the start of one: `waiting`, `stopped`),
    with `-` or `_` for spaces."""
    if not words:
        return None
    out = set()
    for word in words:
        norm = re.sub(r"[-_\s]+", " ", word.strip().lower())
        hits = {s for s in STATES if s == norm or s.startswith(norm + " ")} if norm else set()
        if not hits:
            raise ConfigError(f"--state {word!r} is not a state; use one of: "
                              + ", ".join(s.replace(" ", "-") for s in STATES))
        out |= hits
    return out


def parse_since(text: str | None, now: float) -> float | None:
    """`--since`: a duration back from now (`90m`, `12h`, `7d`, `2w`) or a UTC date or time
    (`2026-12-01`, `2026-12-01T08:00`), as epoch seconds."""
    if text is None:
        return None
    if m := re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([mhdw])\s*", text.lower()):
        return now - float(m[1]) * _UNITS[m[2]]
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(f"--since {text!r} is neither a duration (90m, 12h, 7d, 2w) nor a "
                          "date or time (2026-12-01, 2026-12-01T08:00, UTC)") from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


@dataclass(frozen=True)
class Filters:
    states: set[str] | None
    experiments: set[str]
    since: float | None
    limit: int | None  # ended and standalone runs shown at most; None: all

    def keeps(self, row: dict[str, Any]) -> bool:
        return ((self.states is None or row["state"] in self.states)
                and (not self.experiments or row["experiment"] in self.experiments))

    def wants(self, states: frozenset[str] | set[str]) -> bool:
        return self.states is None or bool(self.states & set(states))


def _rows(instance: dg.DagsterInstance, store: ObjectStore, keys: list[str],
          beats: dict) -> Iterator[dict[str, Any]]:
    """The rows of `keys`, their newest runs read a batch at a time."""
    for i in range(0, len(keys), BATCH):
        batch = keys[i:i + BATCH]
        newest = newest_training_runs(instance, batch)
        for key in batch:
            yield run_summary(instance, store, key, beats, newest.get(key))


def _ended_rows(instance: dg.DagsterInstance, store: ObjectStore, keys: set[str],
                shown: set[str], want: Filters, found: tuple[set[str], dict]
                ) -> Iterator[dict[str, Any]]:
    resumed, beats = found
    scan = recently_ended(instance, keys, resumed, want.since)
    while True:
        batch = [c for _, c in zip(range(BATCH), scan, strict=False)]
        if not batch:
            return
        ids: dict[str, str] = {}
        for key, run_id in batch:  # each key's most recently changed ended run
            ids.setdefault(key, run_id)
        for row in _rows(instance, store, [k for k in ids if k not in shown], beats):
            if row["dagster_run_id"] != ids[row["run"]] or row["run"] in shown:
                continue  # a newer run speaks for this training run
            shown.add(row["run"])
            if row["state"] in CLOSED and want.keeps(row):
                yield row


def select(instance: dg.DagsterInstance, store: ObjectStore,
           want: Filters) -> tuple[list[dict[str, Any]], int]:
    """(the rows shown, how many runs are not shown)."""
    keys = set(instance.get_dynamic_partitions(PARTITIONS_NAME))
    found = (followed(instance), instance.get_daemon_heartbeats())
    rows: list[dict[str, Any]] = []
    if want.wants({s.value for s in State} - CLOSED):
        rows = [r for r in _rows(instance, store, open_partitions(instance, keys, found[0]),
                                 found[1])
                if r["state"] not in CLOSED and want.keeps(r)]
    shown = {r["run"] for r in rows}
    if want.wants(CLOSED) and want.limit != 0:
        ended = 0
        for row in _ended_rows(instance, store, keys, shown, want, found):
            rows.append(row)
            ended += 1
            if want.limit is not None and ended >= want.limit:
                break
    hidden = len(keys) - len(rows)
    if want.wants({STANDALONE}) and want.since is None:
        experiments = want.experiments or {DEFAULT_EXPERIMENT, *(r["experiment"] for r in rows
                                                                 if r["experiment"])}
        standalone = standalone_runs(store, experiments, keys)
        cap = len(standalone) if want.limit is None else want.limit
        rows += [standalone_summary(store, e, run) for e, run in standalone[:cap]]
        hidden += max(0, len(standalone) - cap)
    return rows, hidden


def filters_of(args, now: float | None = None) -> Filters:
    for e in args.experiment:
        validate_name(e, "experiment name")
    if args.limit is not None and args.limit < 0:
        raise ConfigError(f"--limit {args.limit} is negative; give a count of runs (0: only "
                          "open runs)")
    return Filters(parse_states(args.state), set(args.experiment),
                   parse_since(args.since, time.time() if now is None else now),
                   None if args.all else (DEFAULT_LIMIT if args.limit is None else args.limit))


def print_rows(rows: list[dict[str, Any]], hidden: int, want: Filters) -> None:
    if not rows and not hidden:
        print("no training runs (register one: python -m ckpt_assets register NAME "
              "--config FILE)")
        return
    header = ("RUN", "EXPERIMENT", "STATE", "ATTEMPTS", "STEP", "LATEST CHECKPOINT")
    table = [header] + [(r["run"], r["experiment"] or "-", r["state"], str(r["attempts"]),
                         f"{r['latest_step'] if r['latest_step'] is not None else '-'}"
                         f"/{r['max_steps'] or '?'}", r["latest_checkpoint"] or "-")
                        for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row, r in zip(table, [None, *rows], strict=True):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1])
        if r and r["detail"]:  # the reason, or what happens next, under the run's line
            print(f"    {r['detail']}")
    if hidden:
        print(not_shown(hidden, want))


def not_shown(hidden: int, want: Filters) -> str:
    why = ("ended earlier" if want.states is None and not want.experiments
           and want.since is None else "ended earlier or filtered out")
    more = f"--limit {2 * (want.limit or DEFAULT_LIMIT)} or --all" if want.limit is not None \
        else "other filters"
    return f"{hidden} more training run(s) not shown ({why}): {more} shows them"
