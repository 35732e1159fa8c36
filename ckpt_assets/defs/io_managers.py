"""CheckpointIOManager: asset outputs stored with the trainer's own commit protocol.

Each output is a new create-once version of the asset's value in the checkpoint store
(`ckpt_assets.records.asset_versions`, which also says where versions live and how they commit):
nothing is overwritten in place, and a writer killed halfway leaves the previous version
current.

Loading verifies the bytes against the manifest before deserializing anything (JSON for
small structured values, `torch.load(weights_only=True)` for tensors) and refuses a
corrupt object with an error that names the file. An input from `model_checkpoint` is the
verified state dict of the run's newest valid checkpoint (the trainer's walk-back applies),
with a `__checkpoint__` entry describing which checkpoint it is.

Where an asset is stored is set by its definition metadata: `ckpt/store_dir` (default
`assets/<asset>`), `ckpt/filename` (default `value`) and `ckpt/load` (`checkpoint_state` for
model_checkpoint).
"""


import io
import json
import sys
from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from ckpt_assets.base.registration import read_registration, validate_partition_key
from ckpt_assets.defs.resources import CheckpointStore
from ckpt_assets.records.asset_versions import StoredObjectError, VersionedRepo
from trainer.checkpoints.records import CheckpointRecord
from trainer.checkpoints.repo import CheckpointRepo
from trainer.process.contract import Skipped
from trainer.storage import ObjectStore

CHECKPOINT_KEY = "__checkpoint__"  # beside the parts: which checkpoint they are


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What the IO manager hands on beside a loaded checkpoint's parts: the checkpoint's
    record, and the newer checkpoints that failed verification and were skipped."""

    record: CheckpointRecord
    skipped: list[Skipped] = field(default_factory=list)


def _contains_tensor(obj: Any) -> bool:
    # No tensor exists before torch is imported, and a run worker that stores only plain
    # records never imports it: that import was 1.5 s of CPU before a resume's trainer started.
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_contains_tensor(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_contains_tensor(v) for v in obj)
    return False


def serialize(obj: Any) -> tuple[str, bytes]:
    """('json', bytes) for plain structured values, ('torch', bytes) for anything with tensors."""
    if not _contains_tensor(obj):
        try:
            # Strict JSON or none: a value holding NaN or infinity is stored with torch,
            # which keeps it exactly.
            return "json", json.dumps(obj, indent=1, sort_keys=True, allow_nan=False).encode()
        except (TypeError, ValueError):
            pass
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return "torch", buf.getvalue()


def store_dir(asset_key: dg.AssetKey, definition_metadata: dict[str, Any] | None) -> str:
    md = definition_metadata or {}
    return str(md.get("ckpt/store_dir") or f"assets/{'.'.join(asset_key.path)}")


def experiment_of(store: ObjectStore, run: str) -> str:
    reg = read_registration(store, run)
    if reg is None:
        raise StoredObjectError(
            f"training run {run!r} is not registered in store {store.uri}; register it "
            "(python -m ckpt_assets register) or launch its first run with a training config")
    return reg.experiment


def _partition(context) -> str:
    key = context.partition_key if context.has_partition_key else None
    if key is None:
        raise StoredObjectError("CheckpointIOManager stores partitioned assets only "
                                "(partitions: training_runs)")
    return validate_partition_key(key)


def load_checkpoint_state(store: ObjectStore, experiment: str, run: str,
                          log=None) -> dict[str, Any]:
    """The verified state dict of the run's newest valid checkpoint, plus `__checkpoint__`."""
    repo = CheckpointRepo(store, experiment, run)
    manifest, skipped = repo.find_latest_valid()
    for name, reason in skipped:
        if log:
            log.warning(f"CHECKPOINT FALLBACK: {repo.uri(name)} skipped: {reason}")
    if manifest is None:
        raise StoredObjectError(
            f"training run {experiment}/{run} has no valid checkpoint in {store.uri}"
            + (f" ({len(skipped)} failed verification)" if skipped else "")
            + "; materialize model_checkpoint first")
    from trainer.api.state_files import load_rank_state  # imports torch: only when loading
    from trainer.ranks.dcp_storage import is_sharded, read_whole

    # As one rank reads it: every part, whichever rank of a multi-rank save wrote it, and
    # the parts sharded over the ranks (FSDP2, through DCP) read back whole.
    state = load_rank_state(repo, manifest, rank=0, world=1)
    if is_sharded(manifest):
        state.update(read_whole(repo, manifest))
    rec = CheckpointRecord.from_manifest(manifest, repo.uri(manifest.name))
    state[CHECKPOINT_KEY] = LoadedCheckpoint(rec, [Skipped(n, r) for n, r in skipped])
    return state


class CheckpointIOManager(dg.ConfigurableIOManager):
    """Create-once, manifest-verified storage of asset values in the checkpoint store."""

    store: dg.ResourceDependency[CheckpointStore]

    def _repo(self, asset_key: dg.AssetKey, run: str, definition_metadata) -> VersionedRepo:
        store = self.store.open()
        return VersionedRepo(store, experiment_of(store, run), run,
                             store_dir(asset_key, definition_metadata))

    def handle_output(self, context: dg.OutputContext, obj: Any) -> None:
        if obj is None:
            return
        run = _partition(context)
        md = dict(context.definition_metadata or {})
        repo = self._repo(context.asset_key, run, md)
        fmt, payload = serialize(obj)
        filename = f"{md.get('ckpt/filename') or 'value'}.{'json' if fmt == 'json' else 'pt'}"
        meta = {"asset": context.asset_key.to_user_string(), "partition": run,
                "format": fmt, "filename": filename,
                "dagster_run_id": context.run_id}
        m = repo.put(filename, payload, meta)
        context.add_output_metadata({
            "stored_uri": dg.MetadataValue.text(repo.uri(m.name)),
            "stored_version": m.step,
            "stored_sha256": m.files[filename]["sha256"],
            "stored_size": m.files[filename]["size"],
        })
        context.log.info(f"stored {context.asset_key.to_user_string()}[{run}] as "
                         f"{repo.uri(m.name)} ({len(payload)} bytes, {fmt})")

    def load_input(self, context: dg.InputContext) -> Any:
        run = context.asset_partition_key
        validate_partition_key(run)
        upstream = context.upstream_output
        md = dict(upstream.definition_metadata or {}) if upstream else {}
        store = self.store.open()
        if md.get("ckpt/load") == "checkpoint_state":
            return load_checkpoint_state(store, experiment_of(store, run), run, context.log)
        repo = VersionedRepo(store, experiment_of(store, run), run,
                             store_dir(context.asset_key, md))
        value, m = repo.load_current()
        context.log.info(f"loaded {context.asset_key.to_user_string()}[{run}] from "
                         f"{repo.uri(m.name)} (SHA-256 verified)")
        return value
