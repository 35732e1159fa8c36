"""An experiment's failure history as a mean time between failures (MTBF).

Each attempt is told the MTBF of its experiment (`trainer.process.contract.LaunchEnv.mtbf`); a run
whose config says `checkpoint.every_seconds: auto` sets its checkpoint interval from it
(`trainer.base.interval`: T = sqrt(2 * stall * MTBF)).

The experiment's training runs are the runs registered in it (the store's registry names
each run's experiment); their Dagster runs give the wall time trained (start to end, or to
now for one still going) and how each ended; a trainer that died and was relaunched inside
its Dagster run (`ckpt_assets.attempt.in_run`, recorded as the partition's state) is an
attempt and a failure of its own. The failures counted are
the interruptions a checkpoint protects against: preemptions, kills, storage outages and
crash loops. A bug, bad input, divergence or a stop on request end a run; a shorter interval
would not have saved work. MTBF = wall time / failures; until the experiment has a failure,
the run's `checkpoint.mtbf_seconds` holds.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import dagster as dg

from ckpt_assets.base.events import STATE, partition_events
from ckpt_assets.base.queries import is_training_run
from ckpt_assets.base.registration import REGISTRY_PREFIX
from ckpt_assets.base.tags import PARTITION_TAG, TAG_FAILURE_KIND
from trainer.base.interval import Mtbf, MtbfSource
from trainer.base.outcomes import Kind
from trainer.storage import ObjectStore

INTERRUPTIONS = frozenset({Kind.PREEMPTED, Kind.KILLED, Kind.STORAGE, Kind.CRASH_LOOP})
ENDED_BADLY = frozenset({dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED})


@dataclass(frozen=True)
class FailureHistory:
    """What the experiment's attempts add up to."""

    attempts: int
    failures: int
    wall_seconds: float

    def mtbf(self, default_s: float) -> Mtbf:
        if self.failures == 0:
            return Mtbf(float(default_s), MtbfSource.CONFIG, 0, round(self.wall_seconds, 1))
        return Mtbf(self.wall_seconds / self.failures, MtbfSource.HISTORY, self.failures,
                    round(self.wall_seconds, 1))


def experiment_runs(store: ObjectStore, experiment: str) -> list[str]:
    """The training runs registered in `experiment` (the store's registry)."""
    runs = []
    for key in store.list(REGISTRY_PREFIX):
        try:
            entry = json.loads(store.read_bytes(key))
        except (FileNotFoundError, ValueError):
            continue  # an entry being written or damaged: it names no run we can count
        if isinstance(entry, dict) and entry.get("experiment") == experiment and entry.get("run"):
            runs.append(str(entry["run"]))
    return runs


def interruption(instance: dg.DagsterInstance, run: dg.DagsterRun) -> bool:
    """Did this attempt end in a failure a checkpoint protects against?"""
    if run.status not in ENDED_BADLY:
        return False
    decided = run.tags.get(TAG_FAILURE_KIND)
    if decided:  # the resume sensors' reading of it
        try:
            return Kind(decided) in INTERRUPTIONS
        except ValueError:
            return False
    # Not decided yet (no daemon, or its tick is still to come): read it as they would.
    # Imported here: the resume decision imports the jobs, which import the assets, which
    # import this module through the launch.
    from ckpt_assets.base.tags import TAG_NO_RESUME
    from ckpt_assets.lifecycle.ended import failure_of

    if run.tags.get(TAG_NO_RESUME) == "true":
        return False
    return failure_of(instance, run, None).kind in INTERRUPTIONS


def relaunched_in_run(instance: dg.DagsterInstance, partition: str,
                      exclude_run_id: str | None = None) -> int:
    """How many of `partition`'s trainers were interrupted and relaunched inside their
    Dagster run (each such relaunch records the partition's state, with its failure kind)."""
    count = 0
    for md, rec in partition_events(instance, partition, STATE):
        if md.get("relaunched_in_run") and rec.run_id != exclude_run_id:
            try:
                count += Kind(md.get("failure_kind")) in INTERRUPTIONS
            except ValueError:
                continue
    return count


def failure_history(instance: dg.DagsterInstance, runs: list[str], *,
                    exclude_run_id: str | None = None, now: float | None = None
                    ) -> FailureHistory:
    """The attempts of training runs `runs`: how many, how many were interrupted, and the
    wall time they trained (the attempt asking, `exclude_run_id`, left out)."""
    if not runs:
        return FailureHistory(0, 0, 0.0)
    now = time.time() if now is None else now
    records = instance.get_run_records(filters=dg.RunsFilter(tags={PARTITION_TAG: runs}))
    attempts, failures, wall = 0, 0, 0.0
    for rec in records:
        run = rec.dagster_run
        if run.run_id == exclude_run_id or not is_training_run(run) or rec.start_time is None:
            continue
        attempts += 1
        end = rec.end_time if rec.end_time is not None else now
        wall += max(0.0, end - rec.start_time)
        failures += interruption(instance, run)
    relaunched = sum(relaunched_in_run(instance, run, exclude_run_id) for run in runs)
    return FailureHistory(attempts + relaunched, failures + relaunched, wall)


def experiment_mtbf(instance: dg.DagsterInstance, store: ObjectStore, experiment: str,
                    default_s: float, exclude_run_id: str | None = None) -> Mtbf:
    """The MTBF of `experiment` from its failure history, or `default_s` until it has one."""
    history = failure_history(instance, experiment_runs(store, experiment),
                              exclude_run_id=exclude_run_id)
    return history.mtbf(default_s)
