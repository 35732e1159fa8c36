"""DCP checkpoints through our storage writer and reader, committed by the commit protocol.

In one process (DCP without a process group): every kind of value comes back bitwise; the
manifest lists every object DCP wrote with its SHA-256; a flipped byte in a shard or in the
metadata is refused before anything is read, and discovery walks back past it; a value that
only the full unpickler would load is refused; objects are create-once. Slow: the same round
trip through a real S3-compatible server.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from tests.trainer_proc import assert_bitwise_equal
from trainer.base.errors import AlreadyExistsError, CheckpointError
from trainer.checkpoints.repo import CheckpointRepo
from trainer.ranks.dcp_storage import (
    METADATA_FILE,
    NO_DIST_WARNING,
    SafeLoadPlanner,
    StoreReader,
    StoreWriter,
    is_sharded,
    read_whole,
    shard_file,
    the_cause,
)
from trainer.storage import open_store

pytestmark = pytest.mark.filterwarnings(f"ignore:{NO_DIST_WARNING}")


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g),
                  "half": torch.randn(4, generator=g).to(torch.bfloat16),
                  "count": torch.tensor(7), "empty": torch.zeros(0, 2)},
        "optim": {"state": {"w": {"step": torch.tensor(3.0),
                                  "exp_avg": torch.randn(5, 3, generator=g)}},
                  "param_groups": [{"lr": 0.01, "betas": (0.9, 0.99), "params": ["w"]}]},
    }


def _zeros_like(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    return state


def _commit(repo: CheckpointRepo, state: dict, step: int, attempt: int):
    pending = repo.begin(step, attempt)
    save(state, storage_writer=StoreWriter(repo, pending), no_dist=True)
    return repo.commit(pending, {"loss": float(step)})


def _load(repo: CheckpointRepo, manifest, like: dict) -> dict:
    into = _zeros_like(like)
    reader = StoreReader(repo, manifest)
    reader.read_metadata()  # as the session does: a broken checkpoint fails here, plainly
    with the_cause(0):
        load(into, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    return into


def _repo(root: str) -> CheckpointRepo:
    return CheckpointRepo(open_store(root), "exp", "run")


def test_a_dcp_checkpoint_comes_back_bitwise_and_its_manifest_lists_every_object(tmp_path):
    repo = _repo(str(tmp_path))
    attempt = repo.claim(None)
    manifest = _commit(repo, _state(), 1, attempt)
    assert set(manifest.files) == {METADATA_FILE, shard_file(0)} and is_sharded(manifest)
    repo.verify(manifest.name)
    assert_bitwise_equal(_load(repo, manifest, _state()), _state())
    assert_bitwise_equal(read_whole(repo, manifest), _state())


def _flip_a_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damaged", [shard_file(0), METADATA_FILE])
def test_a_flipped_byte_is_refused_before_reading_and_discovery_walks_back_past_it(
        tmp_path, damaged):
    repo = _repo(str(tmp_path))
    attempt = repo.claim(None)
    good = _commit(repo, _state(), 1, attempt)
    newer = _commit(repo, {k: _zeros_like(v) for k, v in _state().items()}, 2, attempt)
    _flip_a_byte(tmp_path / repo.key(newer.name, damaged), at=100)
    with pytest.raises(CheckpointError, match="SHA-256"):
        _load(repo, newer, _state())
    found, skipped = _repo(str(tmp_path)).find_latest_valid()
    assert found.name == good.name and [n for n, _ in skipped] == [newer.name]


class _Opaque:
    """A value only the full unpickler builds: what a crafted checkpoint could carry."""

    def __init__(self, x: int):
        self.x = x


def test_a_value_only_the_full_unpickler_would_load_is_refused(tmp_path):
    repo = _repo(str(tmp_path))
    manifest = _commit(repo, {"extra": {"obj": _Opaque(1)}}, 1, repo.claim(None))
    with pytest.raises(CheckpointError, match="safe loader refuses"):
        read_whole(repo, manifest)


def test_dcp_objects_are_create_once_a_second_save_into_one_checkpoint_is_refused(tmp_path):
    repo = _repo(str(tmp_path))
    pending = repo.begin(1, repo.claim(None))
    save(_state(), storage_writer=StoreWriter(repo, pending), no_dist=True)
    with pytest.raises(AlreadyExistsError), the_cause(0):
        save(_state(), storage_writer=StoreWriter(repo, pending), no_dist=True)


def test_a_checkpoint_without_sharded_state_says_what_to_do(tmp_path):
    repo = _repo(str(tmp_path))
    pending = repo.begin(1, repo.claim(None))
    repo.store.put_new(repo.key(pending.name, "state.pt"), b"x")
    with repo.write_file(pending, "other.pt") as w:
        w.write(io.BytesIO(b"y").getbuffer())
    manifest = repo.commit(pending, {})
    with pytest.raises(CheckpointError, match="holds no sharded state"):
        read_whole(repo, manifest)


@pytest.mark.slow
def test_a_dcp_checkpoint_round_trips_through_a_real_s3_server(s3_env):
    repo = _repo(s3_env["uri"])
    manifest = _commit(repo, _state(), 1, repo.claim(None))
    found, skipped = _repo(s3_env["uri"]).find_latest_valid()
    assert found.name == manifest.name and not skipped
    assert_bitwise_equal(_load(repo, found, _state()), _state())
