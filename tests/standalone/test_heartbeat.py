"""The session's heartbeat thread, in process: liveness whatever a step costs, and never a
beat from an attempt that ended or was superseded."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from trainer.api.session import CheckpointSession
from trainer.base.errors import PointerConflictError, StorageError
from trainer.base.process_id import ProcessId
from trainer.checkpoints.layout import HEARTBEAT
from trainer.checkpoints.records import Beat
from trainer.checkpoints.repo import CheckpointRepo
from trainer.process.contract import Env
from trainer.storage import open_store

BEAT_S = 0.05


def _session(store, **kw) -> CheckpointSession:
    kw.setdefault("every_steps", 5)
    kw.setdefault("heartbeat_seconds", BEAT_S)
    return CheckpointSession(run="r", experiment="e", store=str(store), install_signals=False, **kw)


def _repo(store) -> CheckpointRepo:
    return CheckpointRepo(open_store(str(store)), "e", "r")


def _beat(store) -> Beat | None:
    return _repo(store).read_beat()


def _wait(pred, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _heartbeat_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ckpt-heartbeat"]


def _drop_beat(store) -> None:
    (store / "e" / "r" / HEARTBEAT).unlink(missing_ok=True)


def test_a_step_many_heartbeat_intervals_long_keeps_the_heartbeat_fresh_and_its_step(tmp_path):
    model = torch.nn.Linear(2, 1)
    with _session(tmp_path, max_steps=2) as ckpt:
        ckpt.restore(model=model)
        ckpt.step(1, loss=0.5)
        first = _wait(lambda: (b := _beat(tmp_path)) and b.step == 1 and b, "step 1's beat")
        # The second step is slow (a compiled first step, a cold read): no step() call for
        # as long as it takes to see several more beats, each newer, none of them progress.
        seen = {first.time}

        def newer_beats():
            b = _beat(tmp_path)
            if b is not None:
                assert (b.step, b.step_time) == (1, first.step_time)
                seen.add(b.time)
            return len(seen) >= 4

        _wait(newer_beats, "three more beats during one step")
        ckpt.step(2, loss=0.4)
        last = _wait(lambda: (b := _beat(tmp_path)) and b.step == 2 and b, "step 2's beat")
        assert last.step_time > first.step_time
    assert last.pid == ProcessId.of().pid and last.attempt == 1


def test_beats_start_during_restore_and_carry_the_attempt_and_the_step_it_resumes_from(
        tmp_path):
    seen: list[Beat] = []

    class SlowToLoad:
        """A part whose loading takes as long as it takes for a beat to appear."""

        def state_dict(self):
            return {}

        def load_state_dict(self, _):
            seen.append(_wait(lambda: (b := _beat(tmp_path)) and b.attempt and b,
                              "a beat of the claimed attempt during restore"))

    with _session(tmp_path, max_steps=5) as ckpt:
        ckpt.restore(model=torch.nn.Linear(2, 1), slow=SlowToLoad())
        for step in range(1, 6):
            ckpt.step(step, loss=0.1)
    _drop_beat(tmp_path)
    # The run is finished: continuing it is asked for explicitly.
    with _session(tmp_path, max_steps=5, continue_finished=True) as ckpt:
        ckpt.restore(model=torch.nn.Linear(2, 1), slow=SlowToLoad())
    (beat,) = seen
    assert (beat.attempt, beat.step, beat.resumed_step) == (2, 5, 5)


def test_the_last_beat_says_the_session_ended_and_none_is_written_after_it(tmp_path):
    with _session(tmp_path, max_steps=3) as ckpt:
        ckpt.restore(model=torch.nn.Linear(2, 1))
        for step in range(1, 4):
            ckpt.step(step, loss=0.1)
        assert _wait(lambda: _beat(tmp_path), "a beat").ended is None
    last = _beat(tmp_path)
    assert last.step == 3 and last.ended is not None and last.ended >= last.step_time
    assert _heartbeat_threads() == []
    _drop_beat(tmp_path)
    time.sleep(20 * BEAT_S)
    assert _beat(tmp_path) is None


def _claim_again(store) -> None:
    with pytest.raises(SystemExit) as ended:  # it claims the run, then trains nothing
        with _session(store) as newer:
            newer.restore(model=torch.nn.Linear(2, 1))  # nothing committed yet: a fresh start
    assert ended.value.code == 8  # no_checkpoint


@pytest.mark.parametrize("supersede", [
    pytest.param(lambda store: _repo(store).fence(1), id="the orchestrator fenced it"),
    pytest.param(_claim_again, id="a newer attempt claimed the run"),
])
def test_a_superseded_attempt_stops_beating_and_its_next_step_exits_6(tmp_path, supersede):
    with pytest.raises(SystemExit) as ended:
        with _session(tmp_path) as ckpt:
            ckpt.restore(model=torch.nn.Linear(2, 1))
            ckpt.step(1, loss=0.1)
            supersede(tmp_path)
            _wait(lambda: not any(t.is_alive() for t in _heartbeat_threads()),
                  "the heartbeat thread to see the takeover and stop")
            _drop_beat(tmp_path)
            ckpt.step(2, loss=0.1)
            raise AssertionError("a superseded attempt trained on")
    assert ended.value.code == PointerConflictError.outcome.exit_code == 6
    assert _beat(tmp_path) is None
    assert [n for n in _repo(tmp_path).committed() if n.endswith("-a1")] == []


def test_a_store_error_while_beating_is_logged_once_and_training_goes_on(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="trainer.heartbeat")
    with _session(tmp_path, max_steps=10) as ckpt:
        ckpt.restore(model=torch.nn.Linear(2, 1))
        store, calls = ckpt.repo.store, []

        def unavailable(key, data):
            calls.append(key)
            raise StorageError(f"cannot write {key}: the store is unavailable")

        store.write_overwrite = unavailable
        _wait(lambda: len(calls) >= 3, "three failed beats")
        for step in range(1, 11):
            ckpt.step(step, loss=0.1)
    assert {n.split("-")[1] for n in _repo(tmp_path).committed()} >= {"000000005", "000000010"}
    failures = [r for r in caplog.records if "could not be written" in r.getMessage()]
    assert len(failures) == 1 and "training goes on" in failures[0].getMessage()


def test_an_attempt_the_orchestrator_declared_failed_cannot_claim_the_run_back(
        tmp_path, monkeypatch):
    repo = _repo(tmp_path)
    repo.claim(None, at_least=1, launched=True)
    _repo(tmp_path).fence(1)
    with pytest.raises(PointerConflictError, match="declared failed"):
        _repo(tmp_path).claim(None, at_least=1, launched=True)
    # Launched as the orchestrator launches it: the zombie exits 6 without writing.
    for var, value in {Env.RUN: "r", Env.EXPERIMENT: "e", Env.STORE_URI: str(tmp_path),
                       Env.ATTEMPT: "1"}.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as ended:
        with _session(tmp_path) as zombie:
            zombie.restore(model=torch.nn.Linear(2, 1))
    assert ended.value.code == 6
    # The resume, launched as the next attempt, and a standalone run, are not refused.
    assert _repo(tmp_path).claim(None, at_least=2, launched=True) == 2
    assert _repo(tmp_path).claim(None) == 3
