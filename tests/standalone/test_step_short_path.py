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
import trainer.api.losses as losses_mod
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
    ckpt.close()  # reads step 25's loss, kept unread by its quiet step
    assert ckpt.loop.losses == pytest.approx([0.1 * s for s in range(1, 26)])


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
        if self._job is not None:
            self._job.result()  # the write failed before the step that started it returned

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



def test_loss_tensors_of_quiet_steps_are_read_together_at_the_next_full_step_in_step_order(
        tmp_path, clock):
    ckpt = session(tmp_path, every_steps=10)
    model = torch.nn.Linear(2, 2)
    ckpt.restore(model=model)
    losses = []
    for step in range(1, 10):
        loss = model(torch.ones(1, 2)).sum() * step  # requires grad, as a loop's loss does
        losses.append(loss.item())
        ckpt.step(loss=loss if step % 3 else losses[-1])
    assert ckpt.loop.losses == [losses[0]]  # step 1 took the full path; 2..9 are kept unread
    ckpt.step(loss=torch.tensor(0.5))  # step 10 commits: every loss is read first
    assert ckpt.loop.losses == pytest.approx(losses + [0.5])
    ckpt.close()  # the run's end: final
    resumed = CheckpointSession(run="r", store=str(tmp_path), install_signals=False,
                                continue_finished=True)
    assert resumed.restore(model=model) == 10
    assert resumed.loop.losses == pytest.approx(losses + [0.5])  # the checkpoint's history
    resumed.close()


def test_a_nan_loss_tensor_in_a_quiet_step_is_divergence_named_by_its_step_before_any_commit(
        tmp_path, clock, caplog):
    reached = []
    with pytest.raises(SystemExit) as diverged:
        with session(tmp_path, every_steps=5) as ckpt:
            ckpt.restore(model=torch.nn.Linear(2, 2))
            for step in range(1, 11):
                reached.append(step)
                ckpt.step(loss=torch.tensor(float("nan") if step == 7 else 0.5))
    assert diverged.value.code == 4 and reached[-1] == 10  # read at the commit due at step 10
    assert committed(ckpt) == [(5, "interval")]  # the diverged state is never committed
    assert "loss is nan at step 7; the last good checkpoint is step 5" in caplog.text


def test_a_nan_loss_tensor_is_detected_within_settle_steps_when_nothing_else_is_due(
        tmp_path, clock):
    reached = []
    with pytest.raises(SystemExit) as diverged:
        with session(tmp_path) as ckpt:
            ckpt.restore(model=torch.nn.Linear(2, 2))
            for step in range(1, 1000):
                reached.append(step)
                ckpt.step(loss=torch.tensor(float("inf") if step == 3 else 0.5))
    assert diverged.value.code == 4 and reached[-1] <= 3 + losses_mod.SETTLE_STEPS


def test_a_loss_tensor_changed_in_place_after_its_step_is_refused_as_bad_input(
        tmp_path, clock, caplog):
    total = torch.zeros(())
    with pytest.raises(SystemExit) as refused:
        with session(tmp_path) as ckpt:
            ckpt.restore(model=torch.nn.Linear(2, 2))
            for step in range(1, 6):
                total.zero_()  # an accumulator reused across steps: step 2's value is gone
                total += step
                ckpt.step(loss=total)
            ckpt.save()
    assert refused.value.code == 2 and committed(ckpt) == []
    assert "the loss tensor passed at step 2 was changed in place" in caplog.text


def test_inside_epochs_quiet_batches_take_the_short_path_and_epoch_ends_commit_on_their_step(
        tmp_path, clock, monkeypatch):
    ckpt = session(tmp_path, on_epoch_end=True)
    ckpt.restore(model=torch.nn.Linear(2, 2))
    full = []
    real_full = ckpt._full_step
    monkeypatch.setattr(ckpt, "_full_step", lambda step, *a: full.append(ckpt.loop.step + 1)
                        or real_full(step, *a))
    for _epoch in ckpt.epochs(3, 6):
        for _batch in ckpt.batches():
            ckpt.step(loss=torch.tensor(0.5))
    ckpt.close()
    assert full == [1, 6, 7, 12, 13]  # each epoch's first step and last batch; the run's
    # last epoch ends at close()
    assert committed(ckpt) == [(6, "epoch_end"), (12, "epoch_end"), (18, "final")]
    assert ckpt.loop.losses == [0.5] * 18
