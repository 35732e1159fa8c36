"""The ObjectStore contract, once, against both backends.

`local` is a directory; `s3` is a real moto_server reached through a small fault-injecting
proxy (tests/fault_proxy.py), so the same tests also run with the network failing.
Backend-specific behaviour (multipart uploads, links and FIFOs) follows the shared part.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

import trainer.storage.local as local_mod
from tests.fault_proxy import FaultProxy
from trainer.base.errors import (
    AlreadyExistsError,
    InvalidNameError,
    PointerConflictError,
    StorageError,
)
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import ObjectStore, UnsafeObjectError, WrittenObject, open_store
from trainer.storage.local import LocalStore


@dataclass
class Backend:
    name: str
    store: ObjectStore
    break_writes: object  # () -> context manager in which every write fails for good
    proxy: FaultProxy | None = None
    root: Path | None = None

    def fresh_store(self) -> ObjectStore:
        """A second client of the same store (another process would have its own)."""
        if self.name == "local":
            return LocalStore(self.root)
        from trainer.storage.s3 import S3Store

        return S3Store(self.store.bucket, self.store.prefix, max_attempts=3)


def _local_backend(tmp_path, monkeypatch) -> Backend:
    root = tmp_path / "store"

    @contextmanager
    def disk_full():
        def no_space(*_a, **_k):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        with monkeypatch.context() as m:
            m.setattr(local_mod.os, "write", no_space)
            yield

    return Backend("local", open_store(str(root)), disk_full, root=root)


@contextmanager
def _s3_backend(request, monkeypatch):
    s3_env = request.getfixturevalue("s3_env")
    proxy = FaultProxy(s3_env["endpoint"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    from trainer.storage.s3 import S3Store

    # Three attempts: a retried fault is seen to heal, a persistent one ends quickly.
    store = S3Store(s3_env["bucket"], "ckpts", max_attempts=3, connect_timeout=2,
                    read_timeout=10)

    @contextmanager
    def server_failing():
        proxy.inject("503", times=10_000)
        try:
            yield
        finally:
            proxy.clear()

    try:
        yield Backend("s3", store, server_failing, proxy=proxy)
    finally:
        proxy.close()


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def backend(request, tmp_path, monkeypatch):
    if request.param == "local":
        yield _local_backend(tmp_path, monkeypatch)
    else:
        with _s3_backend(request, monkeypatch) as b:
            yield b


@pytest.fixture
def s3(request, monkeypatch):
    with _s3_backend(request, monkeypatch) as b:
        yield b


@pytest.fixture
def local(tmp_path, monkeypatch):
    return _local_backend(tmp_path, monkeypatch)


# -- create-once ----------------------------------------------------------------------------

def test_objects_round_trip_with_their_size_and_sha256(backend):
    store = backend.store
    written = store.put_new("run1/step-2/model.pt", b"weights")
    assert (written.size, written.sha256) == (7, hashlib.sha256(b"weights").hexdigest())
    assert store.read_bytes("run1/step-2/model.pt") == b"weights"
    assert store.exists("run1/step-2/model.pt") and store.size("run1/step-2/model.pt") == 7
    with store.open_read("run1/step-2/model.pt") as f:
        f.seek(3)
        assert f.read() == b"ghts"
    assert store.uri_for("run1/step-2/model.pt") == f"{store.uri}/run1/step-2/model.pt"


def test_a_committed_object_is_never_overwritten(backend):
    backend.store.put_new("a/b.bin", b"one")
    with pytest.raises(AlreadyExistsError, match=f"{backend.store.uri}/a/b.bin"):
        backend.store.put_new("a/b.bin", b"two")
    assert backend.store.read_bytes("a/b.bin") == b"one"


def test_a_name_taken_while_writing_is_refused_and_the_first_object_kept(backend):
    with pytest.raises(AlreadyExistsError), backend.store.create("a/b.bin") as w:
        w.write(b"mine")
        backend.fresh_store().put_new("a/b.bin", b"the other writer won")
    assert backend.store.read_bytes("a/b.bin") == b"the other writer won"


class Boom(Exception):
    pass


def test_a_write_that_fails_midway_leaves_nothing_visible_and_the_name_free(backend):
    with pytest.raises(Boom), backend.store.create("a/c.bin") as w:
        w.write(b"x" * 1000)
        raise Boom()
    assert not backend.store.exists("a/c.bin") and backend.store.list("a") == []
    backend.store.put_new("a/c.bin", b"retry")
    assert backend.store.read_bytes("a/c.bin") == b"retry"



def test_a_file_written_at_a_given_path_is_committed_create_once_with_its_size_and_sha256(
        backend):
    store, data = backend.store, os.urandom(3 << 20)
    with store.create_from_path("a/file.pt") as (path, result):
        assert not store.exists("a/file.pt")  # nothing is visible inside the block
        Path(path).write_bytes(data)
    assert result == [WrittenObject("a/file.pt", len(data), hashlib.sha256(data).hexdigest())]
    assert store.read_bytes("a/file.pt") == data
    with pytest.raises(AlreadyExistsError, match=f"{store.uri}/a/file.pt"), \
            store.create_from_path("a/file.pt") as (path, _):
        Path(path).write_bytes(b"never written")
    assert store.read_bytes("a/file.pt") == data


def test_a_file_write_that_fails_midway_leaves_nothing_visible_and_the_name_free(backend):
    with pytest.raises(Boom), backend.store.create_from_path("a/f.pt") as (path, result):
        Path(path).write_bytes(b"half")
        raise Boom()
    assert result == [] and backend.store.list("a") == []
    with backend.store.create_from_path("a/f.pt") as (path, _):
        Path(path).write_bytes(b"retry")
    assert backend.store.read_bytes("a/f.pt") == b"retry"

def test_missing_objects_read_as_file_not_found(backend):
    store = backend.store
    for call in (store.read_bytes, store.open_read, store.size):
        with pytest.raises(FileNotFoundError):
            call("nope/x")
    assert store.exists("nope/x") is False
    assert store.read_versioned("nope/x") == (None, None)
    assert store.list("nope") == []


# -- listing and deletion -------------------------------------------------------------------

def test_listing_is_recursive_sorted_and_stops_at_the_prefix_boundary(backend):
    store = backend.store
    for key in ("run1/step-2/model.pt", "run1/step-1/model.pt", "run1/a/b/c.bin",
                "run10/other.pt", "run1.pt"):
        store.put_new(key, b"x")
    assert store.list("run1") == ["run1/a/b/c.bin", "run1/step-1/model.pt",
                                  "run1/step-2/model.pt"]
    assert store.list("run1/step-1") == ["run1/step-1/model.pt"]


def test_a_folders_children_are_the_names_one_level_below_it_and_nothing_deeper(backend):
    store = backend.store
    for key in ("exp/run1/checkpoints/latest.json", "exp/run1/checkpoints/step-1/model.pt",
                "exp/run2/heartbeat.json", "exp/notes.txt", "exp10/run3/x.pt"):
        store.put_new(key, b"x")
    assert store.children("exp") == ["notes.txt", "run1", "run2"]
    assert store.children("exp/run1") == ["checkpoints"]
    assert store.children("nope") == []


def test_a_deleted_object_is_gone_from_reads_and_listings_and_its_siblings_stay(backend):
    store = backend.store
    store.put_new("run1/step-2/model.pt", b"x")
    store.put_new("run1/step-1/model.pt", b"y")
    store.delete("run1/step-2/model.pt")
    store.delete("run1/never-existed.pt")
    assert not store.exists("run1/step-2/model.pt")
    assert store.list("run1") == ["run1/step-1/model.pt"]
    store.put_new("run1/step-2/model.pt", b"a new object under a freed name")


# -- the conditional pointer --------------------------------------------------------------

def test_pointer_updates_chain_through_version_tokens(backend):
    store = backend.store
    t1 = store.write_if("run1/latest.json", b'{"step": 1}', None)
    assert store.read_versioned("run1/latest.json") == (b'{"step": 1}', t1)
    t2 = store.write_if("run1/latest.json", b'{"step": 2}', t1)
    assert t2 != t1 and store.read_versioned("run1/latest.json") == (b'{"step": 2}', t2)


def test_a_stale_pointer_update_is_refused(backend):
    store = backend.store
    t1 = store.write_if("run1/latest.json", b"1", None)
    store.write_if("run1/latest.json", b"2", t1)
    with pytest.raises(PointerConflictError, match="run1/latest.json"):
        store.write_if("run1/latest.json", b"3", t1)
    with pytest.raises(PointerConflictError):
        store.write_if("run1/latest.json", b"3", None)
    assert store.read_versioned("run1/latest.json")[0] == b"2"


def test_a_pointer_deleted_since_it_was_read_is_a_conflict(backend):
    t1 = backend.store.write_if("run1/latest.json", b"{}", None)
    backend.store.delete("run1/latest.json")
    with pytest.raises(PointerConflictError):
        backend.store.write_if("run1/latest.json", b"{}", t1)


def test_of_writers_racing_for_one_pointer_version_exactly_one_wins(backend):
    token = backend.store.write_if("run1/latest.json", b"0", None)
    n = 6
    barrier = threading.Barrier(n)
    outcomes: list[str] = []

    def race(i: int) -> None:
        store = backend.fresh_store()
        barrier.wait()
        try:
            store.write_if("run1/latest.json", str(i + 1).encode(), token)
            outcomes.append("won")
        except PointerConflictError:
            outcomes.append("lost")

    threads = [threading.Thread(target=race, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["lost"] * (n - 1) + ["won"]


def test_overwrite_replaces_unconditionally(backend):
    backend.store.write_overwrite("run1/heartbeat.json", b"1")
    backend.store.write_overwrite("run1/heartbeat.json", b"2")
    assert backend.store.read_bytes("run1/heartbeat.json") == b"2"


def test_attempts_claimed_at_the_same_moment_are_distinct_and_only_the_last_can_commit(backend):
    n = 5
    barrier = threading.Barrier(n)
    claimed: list[tuple[int, CheckpointRepo]] = []

    def claim() -> None:
        repo = CheckpointRepo(backend.fresh_store(), "exp", "r")
        barrier.wait()
        claimed.append((repo.claim(None), repo))

    threads = [threading.Thread(target=claim) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(a for a, _ in claimed) == list(range(1, n + 1))
    committed = []
    for attempt, repo in claimed:
        pending = repo.begin(10, attempt)
        with repo.write_file(pending, "state.pt") as w:
            w.write(b"state of attempt %d" % attempt)
        try:
            repo.commit(pending, {})
            committed.append(attempt)
        except PointerConflictError:
            pass
    assert committed == [n]


# -- names ------------------------------------------------------------------------------

ESCAPING_KEYS = ["../escape", "a/../../b", "/abs", "", "a//b", ".", "a/./b", "a/..", "a\\b",
                 "a/", "a\nb", "a/b\n", "ä/b", "a/%2e%2e"]


@pytest.mark.parametrize("key", ESCAPING_KEYS)
def test_keys_that_could_escape_the_store_are_refused_by_every_operation(backend, key):
    store = backend.store
    calls = [
        (store.put_new, key, b"x"), (store.read_bytes, key), (store.open_read, key),
        (store.exists, key), (store.size, key), (store.list, key), (store.delete, key),
        (store.read_versioned, key), (store.write_if, key, b"x", None),
        (store.write_overwrite, key, b"x"), (store.uri_for, key),
    ]
    for fn, *args in calls:
        with pytest.raises(InvalidNameError):
            fn(*args)


# -- faults -----------------------------------------------------------------------------

def test_a_store_that_cannot_complete_writes_raises_storage_error_and_changes_nothing(backend):
    store = backend.store
    token = store.write_if("run1/latest.json", b"before", None)
    with backend.break_writes():
        with pytest.raises(StorageError) as err:
            store.put_new("run1/x.bin", b"payload")
        assert err.value.exit_code == 5 and store.uri in str(err.value)
        with pytest.raises(StorageError):
            store.write_if("run1/latest.json", b"after", token)
    assert store.read_versioned("run1/latest.json") == (b"before", token)
    assert store.list("run1") == ["run1/latest.json"]
    if backend.root is not None:
        assert [p.name for p in backend.root.rglob("*") if ".tmp-" in p.name] == []


def test_a_full_local_disk_is_reported_as_no_space_left_with_what_to_do(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "s")

    def no_space(*_a, **_k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(local_mod.os, "write", no_space)
    with pytest.raises(StorageError, match="No space left on device") as err:
        store.write_overwrite("r/heartbeat.json", b"{}")
    assert "Free space" in str(err.value) and "--store" in str(err.value)


@pytest.mark.slow
def test_transient_server_errors_are_retried_and_the_write_lands_once(s3):
    s3.proxy.inject("503", times=2, method="PUT")
    s3.store.put_new("run1/x.bin", b"payload")
    assert s3.proxy.faults_served() == 2
    assert s3.store.read_bytes("run1/x.bin") == b"payload"


@pytest.mark.slow
def test_connections_reset_for_good_are_a_storage_error_naming_the_endpoint(s3):
    s3.proxy.inject("reset", times=10_000)
    with pytest.raises(StorageError, match="AWS_ENDPOINT_URL") as err:
        s3.store.read_bytes("run1/x.bin")
    assert err.value.exit_code == 5


@pytest.mark.slow
def test_a_pointer_write_whose_answer_was_lost_is_recognised_as_our_own(s3):
    token = s3.store.write_if("run1/latest.json", b"1", None)
    s3.proxy.inject("drop", method="PUT", path_part="latest.json")
    new = s3.store.write_if("run1/latest.json", b"2", token)
    assert s3.proxy.faults_served() == 1
    assert s3.store.read_versioned("run1/latest.json") == (b"2", new)


@pytest.mark.slow
def test_a_create_whose_answer_was_lost_is_not_mistaken_for_another_writer(s3):
    s3.proxy.inject("drop", method="PUT", path_part="x.bin")
    s3.store.put_new("run1/x.bin", b"payload")
    assert s3.proxy.faults_served() == 1
    assert s3.store.read_bytes("run1/x.bin") == b"payload"


# -- local: links and special files ----------------------------------------------------

def test_links_and_special_files_are_not_objects(local, tmp_path):
    store, root = local.store, local.root
    store.put_new("run1/real.bin", b"real")
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"secret")
    (root / "run1" / "link.bin").symlink_to(outside)
    os.mkfifo(root / "run1" / "fifo.bin")
    (root / "run1" / "dirlink").symlink_to(tmp_path, target_is_directory=True)

    assert store.list("run1") == ["run1/real.bin"]
    for key in ("run1/link.bin", "run1/fifo.bin", "run1/dirlink/outside.bin"):
        assert not store.exists(key) and store.local_path(key) is None
        with pytest.raises(UnsafeObjectError):
            store.read_bytes(key)
        with pytest.raises(UnsafeObjectError):
            store.size(key)
    with pytest.raises(AlreadyExistsError):
        store.put_new("run1/link.bin", b"x")
    with pytest.raises(UnsafeObjectError):
        store.put_new("run1/dirlink/new.bin", b"x")
    store.delete("run1/link.bin")  # removes the link, never what it points to
    assert outside.read_bytes() == b"secret" and not (tmp_path / "new.bin").exists()


def test_a_pointer_that_is_a_link_reads_as_damaged_and_a_conditional_write_replaces_the_link(
        local, tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_bytes(b'{"generation": 1}')
    (local.root / "run1").mkdir(parents=True)
    (local.root / "run1" / "latest.json").symlink_to(target)
    data, token = local.store.read_versioned("run1/latest.json")
    assert data == b"" and token is not None
    local.store.write_if("run1/latest.json", b"mine", token)
    assert local.store.read_bytes("run1/latest.json") == b"mine"
    assert target.read_bytes() == b'{"generation": 1}'


def test_deleting_an_object_removes_the_temp_file_a_killed_writer_left_beside_it(tmp_path):
    """A writer killed between link() and the unlink of its temp file leaves both; deleting
    the object (retention of a dead attempt's partial checkpoint) leaves no directory."""
    store = LocalStore(tmp_path)
    store.put_new("ck/step-1/state.pt", b"x")
    (tmp_path / "ck" / "step-1" / ".state.pt.tmp-0123456789ab").write_bytes(b"x")
    (tmp_path / "ck" / "step-1" / ".other.pt.tmp-0123456789ab").write_bytes(b"in flight")
    store.delete("ck/step-1/state.pt")
    assert sorted(p.name for p in (tmp_path / "ck" / "step-1").iterdir()) == [
        ".other.pt.tmp-0123456789ab"]  # another object's write is not this delete's business
    store.delete("ck/step-1/other.pt")
    assert not (tmp_path / "ck" / "step-1").exists()
