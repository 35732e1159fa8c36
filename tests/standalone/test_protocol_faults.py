"""Faults below the trainer: a damaged pointer, a full disk, two attempts claiming one run,
and a store that holds links, special files or manifests it should not.

Each test names the invariant; none of them may cost a committed checkpoint that verifies.
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

import trainer.storage.local as local_mod
from trainer.api.checkpointer import Checkpointer
from trainer.api.state_files import STATE_FILE
from trainer.base.errors import CheckpointError, PointerConflictError, StorageError
from trainer.checkpoints.layout import POINTER
from trainer.checkpoints.manifest import MANIFEST, checkpoint_name
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import UnsafeObjectError, open_store
from trainer.storage.base import combine_chunks


@pytest.fixture
def root(tmp_path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(root):
    return open_store(str(root))


def _attempt(store, parent=None, keep_last=3, run="r", at_least=1, skipped_from=None):
    """A new attempt as the trainer starts one: discover, claim, checkpointer."""
    repo = CheckpointRepo(store, "exp", run)
    manifest = None
    if parent == "auto":
        manifest, _ = repo.find_latest_valid()
        parent = manifest.name if manifest else None
    attempt = repo.claim(parent, at_least=at_least)
    model = torch.nn.Linear(3, 2)
    ck = Checkpointer(repo, {"model": model}, attempt, keep_last=keep_last, keep_best=False)
    if manifest is not None:
        ck.load(manifest)
    return repo, ck, manifest


def _ckdir(root: Path, run: str = "r") -> Path:
    return root / "exp" / run / "checkpoints"


def _verifying(repo: CheckpointRepo) -> list[str]:
    out = []
    for name in repo.committed():
        try:
            repo.verify(name)
        except CheckpointError:
            continue
        out.append(name)
    return out


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _temp_files(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if ".tmp-" in p.name]


# -- 1. a damaged pointer never costs a committed, verifying checkpoint ------------------

def _three_checkpoints(store, keep_last=3):
    repo, ck, _ = _attempt(store, keep_last=keep_last)
    for step in (10, 20, 30):
        ck.save(step, {})
    return repo


def test_a_deleted_pointer_resumes_from_the_newest_checkpoint_and_retention_keeps_the_last_k(
        store, root):
    _three_checkpoints(store)
    (_ckdir(root) / POINTER).unlink()

    repo, ck, manifest = _attempt(store, parent="auto")
    assert manifest is not None and manifest.name == checkpoint_name(30, 1)
    ck.save(40, {})
    assert repo.committed() == [checkpoint_name(20, 1), checkpoint_name(30, 1),
                                checkpoint_name(40, 2)]


@pytest.mark.parametrize("garbage", [
    b"{not json",
    b'{"generation": "7", "checkpoint": 30}',
    b'{"generation": 3, "checkpoint": "step-000000030-a1", "history": "step-000000020-a1"}',
    b'{"generation": 3, "checkpoint": "../../other/r/checkpoints/step-000000099-a1"}',
    b"[" * 100_000,
], ids=["not-json", "wrong-types", "history-not-a-list", "escaping-name", "deeply-nested"])
def test_an_unreadable_pointer_resumes_from_the_newest_checkpoint_and_loses_none(
        store, root, garbage):
    _three_checkpoints(store)
    (_ckdir(root) / POINTER).write_bytes(garbage)

    repo, ck, manifest = _attempt(store, parent="auto")
    assert manifest is not None and manifest.name == checkpoint_name(30, 1)
    ck.save(40, {})
    assert repo.committed() == [checkpoint_name(20, 1), checkpoint_name(30, 1),
                                checkpoint_name(40, 2)]
    assert repo.read_pointer().timeline == [checkpoint_name(40, 2), checkpoint_name(30, 1),
                                            checkpoint_name(20, 1), checkpoint_name(10, 1)][:4]


def test_after_a_walk_back_the_corrupt_checkpoint_is_neither_counted_nor_kept_over_a_valid_one(
        store, root):
    _three_checkpoints(store, keep_last=2)  # retention already left 20 and 30
    _flip_a_byte(_ckdir(root) / checkpoint_name(30, 1) / STATE_FILE)

    repo, ck, manifest = _attempt(store, parent="auto", keep_last=2)
    assert manifest.name == checkpoint_name(20, 1)
    ck.save(40, {})
    ck.save(50, {})
    assert _verifying(repo) == [checkpoint_name(40, 2), checkpoint_name(50, 2)]
    ck2 = Checkpointer(repo, ck.parts, ck.attempt, keep_last=3, keep_best=False)
    ck2.save(60, {})
    assert checkpoint_name(30, 1) not in repo.read_pointer().timeline
    # The corrupt one is evidence, not history: retention leaves it for a person to inspect.
    assert checkpoint_name(30, 1) in repo.committed()


def test_the_first_save_after_a_walk_back_keeps_the_checkpoint_it_resumed_from(store, root):
    _three_checkpoints(store, keep_last=2)
    _flip_a_byte(_ckdir(root) / checkpoint_name(30, 1) / STATE_FILE)

    repo, ck, manifest = _attempt(store, parent="auto", keep_last=2)
    ck.save(40, {})
    assert set(_verifying(repo)) == {checkpoint_name(20, 1), checkpoint_name(40, 2)}


def test_resuming_an_older_checkpoint_leaves_the_newer_ones_in_place(store):
    _three_checkpoints(store, keep_last=3)
    repo, ck, _ = _attempt(store, parent=checkpoint_name(10, 1), keep_last=2)
    for step in (20, 30, 40):
        ck.save(step, {})
    assert repo.committed() == [checkpoint_name(20, 1), checkpoint_name(30, 1),
                                checkpoint_name(30, 2), checkpoint_name(40, 2)]


def test_repeated_pointer_damage_between_attempts_never_loses_a_verifying_checkpoint(store, root):
    repo, ck, _ = _attempt(store, keep_last=3)
    step = 0
    for damage in ["delete", "garble", "wrong-types", "delete", "garble"]:
        for _ in range(2):
            step += 10
            ck.save(step, {})
        before = set(_verifying(repo))
        pointer = _ckdir(root) / POINTER
        if damage == "delete":
            pointer.unlink()
        elif damage == "garble":
            pointer.write_bytes(b"\x00garbage")
        else:
            pointer.write_text(json.dumps({"generation": 1, "checkpoint": 5, "history": {}}))
        repo, ck, manifest = _attempt(store, parent="auto", keep_last=3)
        assert manifest is not None and manifest.step == step
        # Nothing is deleted until this attempt commits; then only beyond the newest three.
        assert set(_verifying(repo)) == before
        step += 10
        ck.save(step, {})
        after = _verifying(repo)
        assert len(after) == 3 and set(after) <= before | {checkpoint_name(step, ck.attempt)}


# -- 2. a full disk is a storage fault with the reason, and leaves nothing behind ---------

def _no_space(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_claim_on_a_full_disk_is_a_storage_error_that_says_so_and_leaves_no_temp_file(
        store, root, monkeypatch):
    repo, ck, _ = _attempt(store)
    ck.save(10, {})
    pointer_before = (_ckdir(root) / POINTER).read_bytes()

    monkeypatch.setattr(local_mod.os, "write", _no_space)
    with pytest.raises(StorageError, match="No space left on device") as err:
        CheckpointRepo(store, "exp", "r").claim(checkpoint_name(10, 1))
    assert err.value.exit_code == 5 and "--store" in str(err.value)
    assert _temp_files(root) == []
    assert (_ckdir(root) / POINTER).read_bytes() == pointer_before


def test_a_claim_on_an_empty_store_on_a_full_disk_is_a_storage_error(store, root, monkeypatch):
    monkeypatch.setattr(local_mod.os, "write", _no_space)
    with pytest.raises(StorageError, match="No space left on device"):
        CheckpointRepo(store, "exp", "r").claim(None)
    assert _temp_files(root) == []


def test_a_save_that_fills_the_disk_inside_torch_is_a_storage_error_not_a_bug(
        store, root, monkeypatch):
    """torch's native writer reports ENOSPC as a bare RuntimeError; /dev/full gives a real
    ENOSPC to that writer without a special filesystem."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    repo, ck, _ = _attempt(store)
    ck.save(10, {})
    target = _ckdir(root) / checkpoint_name(20, 1)
    target.mkdir()
    monkeypatch.setattr(local_mod, "_temp_name", lambda name: f".{name}.tmp-full")
    (target / f".{STATE_FILE}.tmp-full").symlink_to("/dev/full")

    with pytest.raises(StorageError, match="No space left on device") as err:
        ck.save(20, {})
    assert err.value.exit_code == 5
    assert isinstance(err.value.__cause__, RuntimeError)  # torch's own error, kept as cause
    assert _temp_files(root) == []
    assert repo.read_pointer().checkpoint == checkpoint_name(10, 1)


def test_a_streamed_write_on_a_full_disk_is_a_storage_error_and_leaves_nothing(
        store, root, monkeypatch):
    monkeypatch.setattr(local_mod.os, "write", _no_space)
    with pytest.raises(StorageError, match="No space left on device"):
        store.put_new("exp/r/x.bin", b"payload")
    assert not store.exists("exp/r/x.bin") and _temp_files(root) == []


def test_a_failed_fsync_of_a_checkpoint_file_fails_the_save_instead_of_committing_it(
        store, root, monkeypatch):
    repo, ck, _ = _attempt(store)
    real_fsync = os.fsync

    def failing_fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(f".{STATE_FILE}"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(local_mod.os, "fsync", failing_fsync)
    with pytest.raises(StorageError, match="I/O error"):
        ck.save(10, {})
    assert repo.committed() == [] and _temp_files(root) == []


# -- 3. attempt numbers are claimed, not guessed ------------------------------------------

def test_two_attempts_that_ask_for_the_same_number_get_distinct_ones_and_only_the_later_commits(
        store):
    zombie_repo, zombie, _ = _attempt(store, at_least=1)
    owner_repo, owner, _ = _attempt(store, at_least=1)
    assert (zombie.attempt, owner.attempt) == (1, 2)
    with pytest.raises(PointerConflictError):
        zombie.save(10, {})
    owner.save(10, {})
    assert owner_repo.read_pointer().checkpoint == checkpoint_name(10, 2)


def test_a_claim_takes_a_number_above_every_attempt_seen_in_checkpoint_names(store, root):
    repo, ck, _ = _attempt(store, at_least=7)
    ck.save(10, {})
    (_ckdir(root) / POINTER).unlink()
    assert CheckpointRepo(store, "exp", "r").claim(None, at_least=1) == 8


def _claim_in_a_process(root: str, barrier, out) -> None:
    repo = CheckpointRepo(open_store(root), "exp", "r")
    barrier.wait()
    out.put((repo.claim(None, at_least=1), repo.owner))


def test_attempts_claimed_by_processes_at_the_same_moment_are_all_distinct(root):
    n = 6
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_claim_in_a_process, args=(str(root), barrier, out))
             for _ in range(n)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert sorted(a for a, _ in results) == list(range(1, n + 1))
    ptr = CheckpointRepo(open_store(str(root)), "exp", "r").read_pointer()
    assert (ptr.attempt, ptr.owner) == max(results)


# -- 4. a hostile store cannot hang or mislead discovery ----------------------------------

def _discover_with_a_deadline(store, seconds=60):
    """find_latest_valid on a thread: a test that would hang fails instead."""
    result: list = []
    t = threading.Thread(target=lambda: result.append(
        CheckpointRepo(store, "exp", "r").find_latest_valid()), daemon=True)
    t.start()
    t.join(seconds)
    return result[0] if result else None


def test_a_checkpoint_file_replaced_by_a_link_to_a_fifo_outside_the_store_is_skipped_unopened(
        store, root, tmp_path):
    _three_checkpoints(store)
    fifo = tmp_path / "outside.fifo"
    os.mkfifo(fifo)
    state = _ckdir(root) / checkpoint_name(30, 1) / STATE_FILE
    state.unlink()
    state.symlink_to(fifo)
    try:
        found = _discover_with_a_deadline(store)
    finally:
        # Release a reader that did open the FIFO (the code as it was), so the run ends.
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert found is not None, "discovery blocked on a FIFO"
    manifest, skipped = found
    assert manifest.name == checkpoint_name(20, 1)
    assert skipped[0][0] == checkpoint_name(30, 1) and "symbolic link" in skipped[0][1]


def test_a_fifo_in_place_of_a_checkpoint_file_or_the_pointer_is_never_opened(store, root):
    _three_checkpoints(store)
    state = _ckdir(root) / checkpoint_name(30, 1) / STATE_FILE
    state.unlink()
    os.mkfifo(state)
    pointer = _ckdir(root) / POINTER
    pointer.unlink()
    os.mkfifo(pointer)
    found = _discover_with_a_deadline(store)
    assert found is not None, "discovery blocked on a FIFO"
    assert found[0].name == checkpoint_name(20, 1)
    # The claim replaces the FIFO with a real pointer.
    assert CheckpointRepo(store, "exp", "r").claim(found[0].name) == 2
    assert (_ckdir(root) / POINTER).is_file()


def test_a_link_to_an_identical_copy_outside_the_store_is_not_followed(store, root, tmp_path):
    _three_checkpoints(store)
    state = _ckdir(root) / checkpoint_name(30, 1) / STATE_FILE
    outside = tmp_path / "copy.pt"
    shutil.copy(state, outside)
    state.unlink()
    state.symlink_to(outside)
    manifest, skipped = CheckpointRepo(store, "exp", "r").find_latest_valid()
    assert manifest.name == checkpoint_name(20, 1)
    assert "symbolic link" in skipped[0][1]


def test_writes_through_a_directory_linked_out_of_the_store_are_refused(store, root, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (root / "exp").mkdir(parents=True)
    (root / "exp" / "r").symlink_to(outside)
    with pytest.raises(UnsafeObjectError, match="symbolic link"):
        store.put_new("exp/r/checkpoints/x.bin", b"x")
    with pytest.raises(UnsafeObjectError):
        CheckpointRepo(store, "exp", "r").claim(None)
    assert list(outside.iterdir()) == []
    assert store.list("exp") == [] and not store.exists("exp/r/checkpoints/x.bin")


def test_a_checkpoint_copied_from_another_run_is_refused_and_walked_past(store, root):
    _three_checkpoints(store)
    other, other_ck, _ = _attempt(store, run="other")
    other_ck.save(90, {})
    shutil.copytree(_ckdir(root, "other") / checkpoint_name(90, 1),
                    _ckdir(root) / checkpoint_name(90, 1))
    pointer = json.loads((_ckdir(root) / POINTER).read_text())
    pointer.update(checkpoint=checkpoint_name(90, 1), step=90,
                   history=[checkpoint_name(30, 1), checkpoint_name(20, 1)])
    (_ckdir(root) / POINTER).write_text(json.dumps(pointer))

    manifest, skipped = CheckpointRepo(store, "exp", "r").find_latest_valid()
    assert manifest.name == checkpoint_name(30, 1)
    assert "belongs to run exp/other" in skipped[0][1]


def _rewrite_manifest(root: Path, name: str, change) -> None:
    path = _ckdir(root) / name / MANIFEST
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def _chunked(raw, chunk_size):
    """Chunk digests that add up to the file's digest, as a crafted manifest would list."""
    entry = raw["files"][STATE_FILE]
    chunks = [entry["sha256"]]
    entry.update(chunk_size=chunk_size, chunks=chunks, sha256=combine_chunks(chunks))


MALFORMED = {
    "chunk-size-zero": lambda m: _chunked(m, 0),
    "chunk-size-negative": lambda m: _chunked(m, -64),
    "chunk-count-wrong": lambda m: _chunked(m, 1),
    "size-negative": lambda m: m["files"][STATE_FILE].update(size=-1),
    "size-a-string": lambda m: m["files"][STATE_FILE].update(size="123"),
    "sha256-not-hex": lambda m: m["files"][STATE_FILE].update(sha256="z" * 64),
    "files-empty": lambda m: m.update(files={}),
    "files-a-list": lambda m: m.update(files=[STATE_FILE]),
    "file-name-escapes": lambda m: m["files"].update({"../../../x": m["files"][STATE_FILE]}),
    "step-a-float": lambda m: m.update(step=30.0),
    "step-disagrees-with-name": lambda m: m.update(step=31),
    "parent-escapes": lambda m: m.update(parent="../../x"),
    "meta-a-list": lambda m: m.update(meta=[]),
    "created-at-missing": lambda m: m.pop("created_at"),
}


@pytest.mark.parametrize("change", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_manifest_is_a_checkpoint_error_that_discovery_walks_past(store, root,
                                                                               change):
    _three_checkpoints(store)
    _rewrite_manifest(root, checkpoint_name(30, 1), change)
    repo = CheckpointRepo(store, "exp", "r")
    with pytest.raises(CheckpointError):
        repo.verify(checkpoint_name(30, 1))
    manifest, skipped = repo.find_latest_valid()
    assert manifest.name == checkpoint_name(20, 1) and len(skipped) == 1


def test_a_manifest_that_is_not_json_or_nests_without_end_is_walked_past(store, root):
    _three_checkpoints(store)
    (_ckdir(root) / checkpoint_name(30, 1) / MANIFEST).write_bytes(b"[" * 100_000)
    (_ckdir(root) / checkpoint_name(20, 1) / MANIFEST).write_bytes(b"\xff\xfe")
    manifest, skipped = CheckpointRepo(store, "exp", "r").find_latest_valid()
    assert manifest.name == checkpoint_name(10, 1) and len(skipped) == 2
