"""Reading a checkpoint's state files: each deserialized only after its SHA-256 verified, by
torch's safe loader, and a rank's share of a checkpoint written by several ranks."""

from __future__ import annotations

import pickle
from typing import Any

import torch

from ..base.errors import CheckpointError
from ..checkpoints.manifest import Manifest
from ..checkpoints.repo import CheckpointRepo
from ..ranks.distributed import RNG_PART, rank_file

STATE_FILE = "state.pt"  # a multi-rank save writes state-rank{r}.pt per rank instead
WORLD_SIZE = "world_size"  # the manifest's meta key: how many ranks wrote the checkpoint

def load_rank_state(repo: CheckpointRepo, manifest: Manifest, rank: int,
                    world: int) -> dict[str, Any]:
    """The parts `rank` of `world` restores from `manifest`: every replicated part, and the
    RNG states this rank saved, if the checkpoint was written by as many ranks."""
    saved_world = manifest.meta.get(WORLD_SIZE, 1)
    if saved_world == 1:
        state = load_verified_state(repo, manifest)
        if world > 1:
            state.pop(RNG_PART, None)
        return state
    state: dict[str, Any] = {}
    for r in range(saved_world):
        part = load_verified_state(repo, manifest, rank_file(r))
        rng = part.pop(RNG_PART, None)
        state.update(part)
        if r == rank and saved_world == world and rng is not None:
            state[RNG_PART] = rng
    return state


def load_verified_state(repo: CheckpointRepo, manifest: Manifest,
                        filename: str = STATE_FILE) -> dict[str, Any]:
    """The state dict in `filename` of `manifest`'s checkpoint, deserialized only after its
    SHA-256 verified."""
    key = repo.key(manifest.name, filename)
    uri = repo.store.uri_for(key)
    if filename not in manifest.files:
        raise CheckpointError(f"checkpoint {repo.uri(manifest.name)} lists no {filename}")
    try:
        f = repo.store.open_read(key)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint file {uri} is missing") from e
    with f:
        repo.verify_file(manifest, filename, f)
        path = repo.store.local_path(key)
        if path is not None:
            # Committed files are never rewritten, so mapping the verified file is safe and
            # spares a copy of every tensor.
            return safe_torch_load(path, uri, mmap=True)
        f.seek(0)
        return safe_torch_load(f, uri)


def safe_torch_load(f, where: str, mmap: bool = False) -> Any:
    try:
        return torch.load(f, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{where} holds objects the safe loader refuses (it may carry code that would run "
            f"on load); it was not loaded. Detail: {str(e).splitlines()[0]}"
        ) from e
    except (RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"{where} could not be deserialized: {e}") from e
