"""One row of `ckpt-assets list`: a training run's state, and its latest checkpoint."""

from __future__ import annotations

from typing import Any

import dagster as dg

from ckpt_assets.registration import read_registration
from ckpt_assets.run_state import run_state, without_daemon
from trainer.errors import CheckpointError
from trainer.records import CheckpointRecord
from trainer.repo import CheckpointRepo
from trainer.storage import ObjectStore


def run_summary(instance: dg.DagsterInstance, store: ObjectStore, run_key: str) -> dict[str, Any]:
    """One row of `ckpt-assets list`: the state, and the latest checkpoint from the store."""
    reg = read_registration(store, run_key)
    state = without_daemon(instance, run_state(instance, run_key))
    out: dict[str, Any] = {
        "run": run_key, "experiment": reg.experiment if reg else None,
        "registered": reg is not None, **state.to_dict(),
        "attempts": 0, "latest_step": None, "latest_checkpoint": None,
        # The latest checkpoint's size: all its files, and each part's tensor bytes.
        "latest_checkpoint_bytes": None, "latest_part_bytes": None,
        "max_steps": reg.config.max_steps if reg else None,
    }
    if reg is None:
        return out
    repo = CheckpointRepo(store, reg.experiment, run_key)
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
            out.update(_sizes(repo, ptr.checkpoint))
    return out


def _sizes(repo: CheckpointRepo, name: str) -> dict[str, Any]:
    try:
        m = repo.read_manifest(name)
    except CheckpointError as e:  # the row still says what the pointer names
        return {"error": str(e)}
    rec = CheckpointRecord.from_manifest(m, repo.uri(name))
    return {"latest_checkpoint_bytes": rec.size, "latest_part_bytes": rec.part_bytes or None}
