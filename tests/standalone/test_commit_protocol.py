"""The commit protocol on the local store, in-process (fast)."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.api.checkpointer import Checkpointer
from trainer.api.state_files import load_verified_state
from trainer.base.errors import (
    CheckpointError,
    InvalidNameError,
    PointerConflictError,
)
from trainer.checkpoints.layout import RunLayout, committed, read_heartbeat, read_pointer
from trainer.checkpoints.manifest import MANIFEST
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import open_store


@pytest.fixture
def store(tmp_path):
    return open_store(str(tmp_path / "store"))


def _ck(store, attempt=1, keep_last=2, run="r"):
    repo = CheckpointRepo(store, "exp", run)
    model = torch.nn.Linear(4, 2)
    assert repo.claim(None, at_least=attempt) == attempt
    return repo, model, Checkpointer(repo, {"model": model}, attempt, keep_last=keep_last,
                                     keep_best=False)


@pytest.mark.parametrize("name", ["../evil", "a/b", "UPPER", "-lead", "x" * 65, "a..b", ""])
def test_run_names_that_break_the_rule_are_refused_with_the_rule(store, name):
    with pytest.raises(InvalidNameError, match="lowercase letters, digits"):
        CheckpointRepo(store, "exp", name)


def test_a_runs_pointer_heartbeat_and_checkpoints_are_where_its_layout_names_them(store):
    repo, model, ck = _ck(store)
    ck.save(1, {})
    repo.heartbeat({"step": 1})
    layout = RunLayout(store, "exp", "r")
    assert (layout.pointer_key, layout.heartbeat_key, layout.configs_prefix) == (
        "exp/r/checkpoints/latest.json", "exp/r/heartbeat.json", "exp/r/configs")
    assert read_pointer(layout) == repo.read_pointer()
    assert read_heartbeat(layout) == repo.read_heartbeat()
    assert committed(layout) == repo.committed() == ["step-000000001-a1"]
    models = RunLayout(store, "exp", "r", versions="models")
    assert models.pointer_key == "exp/r/models/latest.json" and read_pointer(models) is None
    with pytest.raises(InvalidNameError, match="segment '..'"):
        RunLayout(store, "exp", "r", versions="../other")


def test_the_pointer_moves_only_after_the_manifest_exists(store):
    repo, model, ck = _ck(store)
    ck.save(1, {})
    ptr = repo.read_pointer()
    assert ptr.checkpoint == "step-000000001-a1"
    assert store.exists(repo.key(ptr.checkpoint, MANIFEST))


def test_a_checkpoint_without_manifest_does_not_exist(store):
    repo, model, ck = _ck(store)
    ck.save(1, {})
    pending = repo.begin(2, 1)
    with repo.write_file(pending, "state.pt") as w:
        w.write(b"half a checkpoint")
    # killed here: no manifest, pointer not moved
    assert repo.committed() == ["step-000000001-a1"]
    manifest, skipped = repo.find_latest_valid()
    assert manifest.step == 1 and skipped == []


def test_a_second_attempt_claiming_the_run_stops_the_first_from_advancing_it(store):
    repo1, model, ck1 = _ck(store, attempt=1)
    ck1.save(1, {})
    repo2, _, ck2 = _ck(store, attempt=2)
    with pytest.raises(PointerConflictError, match="another attempt took over"):
        ck1.save(2, {})
    assert repo2.read_pointer().checkpoint == "step-000000001-a1"
    ck2.save(2, {})
    assert repo2.read_pointer().checkpoint == "step-000000002-a2"


def test_retention_keeps_the_last_k_and_never_what_the_pointer_names(store):
    repo, model, ck = _ck(store, keep_last=2)
    for step in range(1, 6):
        ck.save(step, {})
    assert repo.committed() == ["step-000000004-a1", "step-000000005-a1"]
    assert repo.read_pointer().checkpoint == "step-000000005-a1"


def test_retention_keeps_the_best_checkpoint_beyond_the_last_k(store):
    repo = CheckpointRepo(store, "exp", "r")
    repo.claim(None)
    ck = Checkpointer(repo, {"model": torch.nn.Linear(2, 2)}, 1, keep_last=1, keep_best=True)
    ck.save(1, {"is_best": True, "best_score": 0.5})
    for step in (2, 3, 4):
        ck.save(step, {"is_best": False})
    assert repo.committed() == ["step-000000001-a1", "step-000000004-a1"]


def test_corrupt_newest_checkpoint_falls_back_to_the_previous_valid_one(store, tmp_path, caplog):
    repo, model, ck = _ck(store, keep_last=3)
    ck.save(1, {})
    ck.save(2, {})
    path = tmp_path / "store" / repo.key("step-000000002-a1", "state.pt")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    manifest, skipped = repo.find_latest_valid()
    assert manifest.step == 1
    assert skipped[0][0] == "step-000000002-a1" and "SHA-256" in skipped[0][1]
    assert "CHECKPOINT FALLBACK" in caplog.text


def test_an_unreadable_pointer_falls_back_to_scanning_manifests(store, tmp_path):
    repo, model, ck = _ck(store)
    ck.save(1, {})
    ck.save(2, {})
    (tmp_path / "store" / repo.pointer_key).write_text("{not json")
    manifest, _ = repo.find_latest_valid()
    assert manifest.step == 2


def test_a_multi_chunk_file_verifies_and_a_flipped_bit_names_its_chunk(tmp_path, monkeypatch):
    import trainer.checkpoints.verification as verification
    import trainer.storage.base as base

    monkeypatch.setattr(base, "CHUNK_SIZE", 4096)
    monkeypatch.setattr(verification, "CHUNK_SIZE", 4096)
    store = open_store(str(tmp_path / "s"))
    repo = CheckpointRepo(store, "exp", "r")
    repo.claim(None)
    model = torch.nn.Linear(64, 64)
    pending = repo.begin(1, 1)
    with repo.write_file(pending, "state.pt") as w:
        w.chunk_size = 4096
        torch.save({"model": model.state_dict()}, w)
    m = repo.commit(pending, {})
    m.files["state.pt"]["chunk_size"] = 4096
    entry = json.loads(store.read_bytes(repo.key(m.name, MANIFEST)))["files"]["state.pt"]
    assert len(entry["chunks"]) > 2
    state = load_verified_state(repo, m)
    assert torch.equal(state["model"]["weight"], model.weight)
    path = tmp_path / "s" / repo.key(m.name, "state.pt")
    data = bytearray(path.read_bytes())
    data[4096 * 2 + 10] ^= 0x80
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="chunk 2"):
        repo.verify_file(m, "state.pt", open(path, "rb"))


def test_after_a_walk_back_the_next_checkpoint_names_the_one_it_was_resumed_from(store, tmp_path):
    repo, model, ck = _ck(store, keep_last=3)
    ck.save(1, {})
    ck.save(2, {})
    path = tmp_path / "store" / repo.key("step-000000002-a1", "state.pt")
    path.write_bytes(path.read_bytes()[:-10])
    repo2 = CheckpointRepo(store, "exp", "r")
    manifest, skipped = repo2.find_latest_valid()
    assert repo2.claim(manifest.name) == 2
    ck2 = Checkpointer(repo2, {"model": model}, 2, keep_last=3, keep_best=False)
    ck2.load(manifest)
    ck2.save(2, {})
    assert repo2.read_manifest("step-000000002-a2").parent == "step-000000001-a1"
