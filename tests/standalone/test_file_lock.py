"""The local store's pointer lock is waited for with a bound: a writer stuck holding it, or
stopped while holding it, fails the next writer with one error that names it, and nothing
is written. (A trainer frozen inside a commit once hung the reconciler's fence for good;
tests/orchestrator/test_sensors.py shows the reconciler kill that trainer and fence the run after.)"""

from __future__ import annotations

import fcntl
import os
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

import trainer.storage.file_lock as file_lock
from trainer.base.errors import LockHeldError, StorageError
from trainer.storage.local import LocalStore

KEY = "exp/run/latest.json"


@pytest.fixture
def store(tmp_path) -> LocalStore:
    s = LocalStore(tmp_path)
    s.write_if(KEY, b"v1", None)
    return s


@contextmanager
def held(store: LocalStore):
    """The pointer's lock, held through a second open file description (as another process
    would hold it: flock locks belong to the open file, not to the process)."""
    fd = os.open(store.root / Path(KEY).parent / f".{Path(KEY).name}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # never waits: nothing else may hold it
        yield fd
    finally:
        os.close(fd)


def test_the_holder_of_a_pointer_lock_is_found_by_its_pid(store):
    with held(store) as fd:
        assert file_lock.lock_holders(fd) == (os.getpid(), os.getpid())


@pytest.mark.slow
def test_a_child_forked_while_a_commit_holds_the_lock_does_not_hold_it(store):
    # A DataLoader worker forked while the background commit holds the pointer's lock.
    dfd = os.open(store.root / "exp" / "run", os.O_RDONLY | os.O_DIRECTORY)
    (go, go_w), (up, up_w) = os.pipe(), os.pipe()
    try:
        with file_lock.exclusive_lock(dfd, ".latest.json.lock", "the pointer"):
            child = os.fork()
            if child == 0:  # past its fork hooks: it says so, and idles until told to end
                os.write(up_w, b"r")
                os.read(go, 1)
                os._exit(0)
    finally:
        os.close(dfd)
    try:
        assert os.read(up, 1) == b"r"
        _, token = store.read_versioned(KEY)
        with held(store) as fd:  # taken at once: the child's copy was closed at the fork
            assert file_lock.lock_holders(fd) == (os.getpid(), os.getpid())
        store.write_if(KEY, b"v2", token)
    finally:
        os.write(go_w, b"x")
        os.waitpid(child, 0)
        for fd in (go, go_w, up, up_w):
            os.close(fd)


def test_a_pointer_write_waits_for_a_lock_held_briefly_and_then_succeeds(store):
    _, token = store.read_versioned(KEY)
    with held(store):
        done: list[str] = []
        writer = threading.Thread(target=lambda: done.append(store.write_if(KEY, b"v2", token)))
        writer.start()
        writer.join(0.2)
        assert not done  # it waits while the lock is held
    writer.join(30)
    assert done and store.read_versioned(KEY)[0] == b"v2"


def test_a_lock_held_past_the_wait_fails_the_write_naming_its_holder_and_writes_nothing(
        store, monkeypatch):
    monkeypatch.setattr(file_lock, "LOCK_WAIT_S", 0.3)
    _, token = store.read_versioned(KEY)
    with held(store), pytest.raises(LockHeldError) as raised:
        store.write_if(KEY, b"v2", token)
    said = str(raised.value)
    assert said.startswith(f"{store.uri_for(KEY)} (its lock file .latest.json.lock) is locked "
                           f"by process {os.getpid()}, which still holds it after 0.3s")
    assert "nothing was written" in said and f"kill {os.getpid()}" in said
    assert isinstance(raised.value, StorageError)  # the attempt fails as storage, resumable
    assert store.read_versioned(KEY) == (b"v1", token)


def test_a_lock_held_by_a_stopped_process_is_not_waited_for(store, monkeypatch):
    # The wait is long; the message says the holder is stopped, so the wait did not run out.
    monkeypatch.setattr(file_lock, "LOCK_WAIT_S", 3600)
    monkeypatch.setattr(file_lock, "process_state", lambda pid: "T")
    _, token = store.read_versioned(KEY)
    with held(store), pytest.raises(LockHeldError, match="which is stopped"):
        store.write_if(KEY, b"v2", token)
    assert store.read_versioned(KEY) == (b"v1", token)


def test_the_state_of_a_running_process_and_of_none_are_told():
    assert file_lock.process_state(os.getpid()) in ("R", "S")
    assert file_lock.process_state(2**22 + 1) is None
