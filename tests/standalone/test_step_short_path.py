"""`CheckpointSession.step`'s short path: most steps are decided from what the last full step
worked out, and they decide exactly as the full path would (triggers, progress reports,
stops, errors of a background save, refused steps, debug lines).

In process; time is a fake clock handed to the session, so nothing here waits or is timed.
"""

from __future__ import annotations

import errno
import logging
import time

import pytest
import torch

import trainer.api.checkpointer as checkpointer_mod
import trainer.api.session as session_mod
import trainer.api.session_open as session_open
from trainer.api.session import CheckpointSession
from trainer.process.contract import Progress

START = 1000.0  # the fake clock at restore()


class Clock:
    """The session's `time` module with a monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = START

    def monotonic(self) -> float:
        return self.now

    def __getattr__(self, name: str):
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    for module in (session_mod, session_open):  # every module of the session reading time
        monkeypatch.setattr(module, "time", fake)
    return fake


def session(tmp_path, **triggers) -> CheckpointSession:
    base = {"every_steps": None, "every_seconds": None, "on_epoch_end": False,
            "on_best": False, "heartbeat_seconds": 60}
    return CheckpointSession(run="r", store=str(tmp_path), resume="never",
                             install_signals=False, **{**base, **triggers})


def committed(ckpt: CheckpointSession) -> list[tuple[int, str]]:
    repo = ckpt.repo
    return [(m.step, m.meta["reason"]) for m in map(repo.read_manifest, repo.committed())]


def test_progress_reports_and_time_saves_come_when_due_and_a_manual_save_restarts_the_timer(
        tmp_path, clock, monkeypatch):
    sent = []
    ckpt = session(tmp_path, every_seconds=10, heartbeat_seconds=5)
    ckpt.restore(model=torch.nn.Linear(2, 2))
    monkeypatch.setattr(ckpt.reporter, "send", sent.append)
    for step in range(1, 26):
        clock.now = START + step  # one second a step
        ckpt.step(step, loss=0.1 * step)
        if step == 14:
            ckpt.save()
    assert [(p.step, p.loss) for p in sent if isinstance(p, Progress)] == [
        (s, pytest.approx(0.1 * s)) for s in (1, 6, 11, 16, 21)]
    assert committed(ckpt) == [(10, "time"), (14, "manual"), (24, "time")]
    assert ckpt.loop.losses == pytest.approx([0.1 * s for s in range(1, 26)])
    ckpt.close()


def test_step_triggers_commit_on_their_step_and_the_last_step_at_close(tmp_path, clock):
    ckpt = session(tmp_path, every_steps=4, max_steps=10)
    ckpt.restore(model=torch.nn.Linear(2, 2))
    for step in range(1, 11):
        ckpt.step(step, loss=0.5)
    assert committed(ckpt) == [(4, "interval"), (8, "interval")]
    ckpt.close()
    assert committed(ckpt) == [(4, "interval"), (8, "interval"), (10, "final")]


def test_a_stop_requested_between_quiet_steps_commits_the_next_step_and_stops(tmp_path, clock):
    ckpt = session(tmp_path)
    ckpt.restore(model=torch.nn.Linear(2, 2))
    assert [ckpt.step(step, loss=0.5) for step in range(1, 6)] == [False] * 5
    ckpt.stop.signal_name = "SIGTERM"  # what the handler sets
    with pytest.raises(SystemExit) as stop:
        ckpt.step(6, loss=0.5)
    assert stop.value.code == 143 and committed(ckpt) == [(6, "preempted")]


@pytest.mark.parametrize("bad", [3, 2.5, None])
def test_a_repeated_or_non_integer_step_or_a_non_finite_loss_after_quiet_steps_is_refused(
        tmp_path, clock, bad):
    with pytest.raises(SystemExit) as refused:
        with session(tmp_path) as ckpt:
            ckpt.restore(model=torch.nn.Linear(2, 2))
            for step in range(1, 4):
                ckpt.step(step, loss=0.5)
            if bad is None:
                ckpt.step(4, loss=float("nan"))
            else:
                ckpt.step(bad, loss=0.5)
    assert refused.value.code == (4 if bad is None else 2)
    assert ckpt.loop.step == 3 and committed(ckpt) == []


def test_a_background_save_that_failed_fails_the_next_step_even_when_it_ended_before_its_step_returned(
        tmp_path, clock, monkeypatch):
    def failing(state, dest):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    real_save = checkpointer_mod.Checkpointer.save

    def save_that_ends_at_once(self, step, meta):
        real_save(self, step, meta)
        if self._thread is not None:
            self._thread.join()  # the write failed before the step that started it returned

    monkeypatch.setattr(checkpointer_mod, "_save", failing)
    monkeypatch.setattr(checkpointer_mod.Checkpointer, "save", save_that_ends_at_once)
    reached = []
    with pytest.raises(SystemExit) as failed:
        with session(tmp_path, every_steps=2, async_save=True) as ckpt:
            ckpt.restore(model=torch.nn.Linear(2, 2))
            for step in range(1, 6):
                reached.append(step)
                ckpt.step(step, loss=0.5)
    assert failed.value.code == 5 and reached == [1, 2, 3]


def test_with_debug_logging_every_step_logs_its_line(tmp_path, clock, caplog):
    caplog.set_level(logging.DEBUG, logger="trainer")
    ckpt = session(tmp_path)
    ckpt.restore(model=torch.nn.Linear(2, 2))
    for step in range(1, 7):
        ckpt.step(step, loss=0.5)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert lines == [f"step {s} done loss 0.5" for s in range(1, 7)]
    ckpt.close()
