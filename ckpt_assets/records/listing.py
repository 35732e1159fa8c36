"""One row of `ckpt-assets list`: a training run's state, and its latest checkpoint.

Registered runs are the `training_runs` partitions. Standalone runs (a script's
`CheckpointSession` or `python -m trainer`, never launched through Dagster) exist only in
the store: `standalone_runs` finds them by their pointer
(`<experiment>/<run>/checkpoints/latest.json`) in the experiments it is asked about (the
store has no index of experiments; an experiment's folder is read one level deep, and a row
reads its run's pointer and latest manifest, never the list of its checkpoints).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import dagster as dg

from ckpt_assets.base.registration import read_registration
from ckpt_assets.lifecycle.state import run_state, without_daemon
from trainer.base.errors import CheckpointError
from trainer.checkpoints.layout import CHECKPOINTS, POINTER
from trainer.checkpoints.records import CheckpointRecord
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import ObjectStore, is_segment

# The state of a run that only the store knows of.
STANDALONE = "standalone"
STANDALONE_DETAIL = ("never launched through Dagster (its script or `python -m trainer` "
                     "committed these checkpoints); `ckpt-assets lineage {run} --experiment "
                     "{experiment}` lists them")
DEFAULT_EXPERIMENT = "default"  # trainer.config.TrainConfig.experiment's default


def _row(run_key: str, experiment: str | None, max_steps: int | None) -> dict[str, Any]:
    return {"run": run_key, "experiment": experiment, "registered": False,
            "attempts": 0, "latest_step": None, "latest_checkpoint": None,
            # The latest checkpoint's size: all its files, and each part's tensor bytes.
            "latest_checkpoint_bytes": None, "latest_part_bytes": None,
            "max_steps": max_steps}


def run_summary(instance: dg.DagsterInstance, store: ObjectStore, run_key: str,
                beats: dict | None = None, newest: dg.DagsterRun | None = None
                ) -> dict[str, Any]:
    """One row of `ckpt-assets list`: the state, and the latest checkpoint from the store
    (`beats`, `newest`: the instance's daemon heartbeats and the run's newest Dagster run,
    when read already for many rows)."""
    reg = read_registration(store, run_key)
    state = without_daemon(instance, run_state(instance, run_key, newest=newest), beats=beats)
    out = {**_row(run_key, reg.experiment if reg else None, _config_goal(reg)),
           "registered": reg is not None, **state.to_dict()}
    if reg is None:
        return out
    return _from_store(CheckpointRepo(store, reg.experiment, run_key), out)


def _config_goal(reg) -> int | None:
    """The config's step count where it is the goal: a task trains to it; a command's script
    is never handed it (its session's own `max_steps`, from the manifest, is the goal)."""
    return reg.config.max_steps if reg and reg.config.command is None else None


def standalone_summary(store: ObjectStore, experiment: str, run_key: str) -> dict[str, Any]:
    """The row of a run only the store knows of: what its pointer says."""
    out = {**_row(run_key, experiment, None), "state": STANDALONE,
           "detail": STANDALONE_DETAIL.format(run=run_key, experiment=experiment),
           "dagster_run_id": None, "attempt": None, "resume_at": None}
    return _from_store(CheckpointRepo(store, experiment, run_key), out)


def standalone_runs(store: ObjectStore, experiments: Iterable[str],
                    known: set[str]) -> list[tuple[str, str]]:
    """(experiment, run) of each run with a pointer in `experiments` whose name is not in
    `known` (the registered runs) and that has no registration of its own. Reads each
    experiment's folder one level deep and each unknown run's pointer, never the
    checkpoints beneath."""
    found = []
    for experiment in sorted(set(experiments)):
        if not is_segment(experiment):
            continue
        for run in store.children(experiment):
            if (run not in known and is_segment(run)
                    and store.exists(f"{experiment}/{run}/{CHECKPOINTS}/{POINTER}")):
                found.append((experiment, run))
    return [(e, r) for e, r in found if _unregistered(store, r)]


def _unregistered(store: ObjectStore, run_key: str) -> bool:
    try:
        return read_registration(store, run_key) is None
    except Exception:  # a registry entry that does not read: a registered run, not ours
        return False


def _from_store(repo: CheckpointRepo, out: dict[str, Any]) -> dict[str, Any]:
    try:
        ptr = repo.read_pointer()
    except CheckpointError as e:
        out["error"] = str(e)
        ptr = None
    if ptr:
        out["attempts"] = ptr.attempt
        if ptr.checkpoint:
            out["latest_step"] = ptr.step
            out["latest_checkpoint"] = repo.uri(ptr.checkpoint)
            out.update(_latest(repo, ptr.checkpoint))
    return out


def _latest(repo: CheckpointRepo, name: str) -> dict[str, Any]:
    """The latest checkpoint's size, and the step count its session trains to: a command's
    script says it (its own `max_steps`), so the config need not repeat it."""
    try:
        m = repo.read_manifest(name)
    except CheckpointError as e:  # the row still says what the pointer names
        return {"error": str(e)}
    rec = CheckpointRecord.from_manifest(m, repo.uri(name))
    told = m.meta.get("max_steps")
    return {"latest_checkpoint_bytes": rec.size, "latest_part_bytes": rec.part_bytes or None,
            **({"max_steps": told} if isinstance(told, int) and told > 0 else {})}
