"""Background saves (`async_save`): the snapshot is the state of its step, the optimizer is
the only thing that waits for it, and a failed write fails the attempt at the next step.

In process and fast: copies and writes are held at gates (events), so every ordering here is
forced, never timed.
"""

from __future__ import annotations

import errno
import threading
import time

import pytest
import torch
from torch import nn

import trainer.api.checkpointer as checkpointer_mod
from tests.trainer_proc import assert_bitwise_equal
from trainer import CheckpointSession
from trainer.api.checkpointer import Checkpointer, RNGState
from trainer.api.snapshot import HostBuffers
from trainer.api.state_files import load_verified_state
from trainer.base.outcomes import Outcome
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import open_store

DEADLINE_S = 60.0


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # Large layers go through the host buffers and the fence; BatchNorm's running statistics
    # (changed by every forward) and the small last layer are copied at once.
    model = nn.Sequential(nn.Linear(64, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def forward_backward(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    opt.zero_grad()
    model(torch.randn(32, 64, generator=g)).pow(2).mean().backward()


def train(model, opt, steps) -> None:
    for step in steps:
        forward_backward(model, opt, step)
        opt.step()


def checkpointer(tmp_path, name, model, opt, async_save) -> tuple[CheckpointRepo, Checkpointer]:
    repo = CheckpointRepo(open_store(str(tmp_path / name)), "exp", "r")
    repo.claim(None)
    parts = {"model": model, "optimizer": opt, "rng": RNGState()}
    return repo, Checkpointer(repo, parts, 1, keep_last=5, async_save=async_save)


def committed_state(repo: CheckpointRepo) -> dict:
    return load_verified_state(repo, repo.verify(repo.read_pointer().checkpoint))


class Gate:
    """Holds every call of a function until opened; says when the first call arrived."""

    def __init__(self, monkeypatch, owner, name: str):
        self.arrived, self.opened = threading.Event(), threading.Event()
        real = getattr(owner, name)

        def held(*args, **kwargs):
            self.arrived.set()
            assert self.opened.wait(DEADLINE_S), "the gate was never opened"
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, held)


def until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_snapshot_taken_while_training_goes_on_is_exactly_the_state_of_its_step(
        tmp_path, monkeypatch):
    model, opt = build()
    repo_a, ck_a = checkpointer(tmp_path, "async", model, opt, async_save=True)
    # The reference is a synchronous save of the same parts at the same step, not a second
    # model trained alongside: the invariant is about the snapshot, not about two trainings
    # agreeing bit for bit.
    repo_b, ck_b = checkpointer(tmp_path, "sync", model, opt, async_save=False)
    train(model, opt, range(1, 4))
    torch.manual_seed(123)  # the generators' state at step 3, in both saves
    ck_b.save(3, {})

    copy_gate = Gate(monkeypatch, HostBuffers, "get")
    torch.manual_seed(123)
    ck_a.save(3, {})
    # The save returned with the copy held; forward and backward of the next step run on,
    # and change what a careless snapshot would pick up (BatchNorm's statistics, gradients).
    forward_backward(model, opt, 4)
    torch.rand(5)
    stepped = threading.Thread(target=opt.step)
    stepped.start()
    assert copy_gate.arrived.wait(DEADLINE_S)
    stepped.join(0.5)
    assert stepped.is_alive(), "the optimizer wrote its tensors before the snapshot copied them"
    copy_gate.opened.set()
    stepped.join(DEADLINE_S)
    assert not stepped.is_alive()
    train(model, opt, range(5, 8))
    ck_a.close()
    step_3 = committed_state(repo_b)
    assert_bitwise_equal(step_3, committed_state(repo_a))
    assert not torch.equal(model[0].weight, step_3["model"]["0.weight"])  # trained on meanwhile


def test_host_buffers_are_allocated_once_and_reused_by_every_later_save(tmp_path):
    model, opt = build()
    repo, ck = checkpointer(tmp_path, "s", model, opt, async_save=True)
    allocated = []
    for step in range(1, 4):
        train(model, opt, [step])
        ck.save(step, {})
        ck.wait()
        allocated.append(ck._buffers.allocations)
    assert allocated[0] > 0 and allocated == [allocated[0]] * 3
    assert_bitwise_equal(committed_state(repo)["model"], model.state_dict())


def test_at_most_one_save_is_in_flight_the_next_one_waits_for_its_write(tmp_path, monkeypatch):
    model, opt = build()
    repo, ck = checkpointer(tmp_path, "s", model, opt, async_save=True)
    write_gate = Gate(monkeypatch, checkpointer_mod, "_save")
    train(model, opt, [1])
    ck.save(1, {})
    assert write_gate.arrived.wait(DEADLINE_S)
    train(model, opt, [2])  # the copy is done: the optimizer does not wait for the write
    second = threading.Thread(target=ck.save, args=(2, {}))
    second.start()
    second.join(0.5)
    assert second.is_alive() and repo.read_pointer().checkpoint is None
    write_gate.opened.set()
    second.join(DEADLINE_S)
    ck.close()
    assert repo.read_pointer().step == 2
    assert [repo.read_manifest(n).step for n in repo.committed()] == [1, 2]


def session(tmp_path, **triggers) -> CheckpointSession:
    return CheckpointSession(run="r", store=str(tmp_path), resume="never", on_epoch_end=False,
                             on_best=False, install_signals=False, async_save=True, **triggers)


def test_the_stall_of_each_save_is_in_its_manifest_and_its_checkpoint_record(
        tmp_path, monkeypatch):
    records = []
    with session(tmp_path, max_steps=4, every_steps=2) as ckpt:
        model, opt = build()
        ckpt.restore(model=model, optimizer=opt)
        monkeypatch.setattr(ckpt.reporter, "send", records.append)
        for step in range(1, 5):
            train(model, opt, [step])
            ckpt.step(step, loss=0.5)
    repo = ckpt.repo
    stalls = [repo.read_manifest(n).meta["blocking_seconds"] for n in repo.committed()]
    assert len(stalls) == 2 and all(isinstance(s, float) and s >= 0 for s in stalls)
    saved = [r for r in records if type(r).__name__ == "CheckpointRecord"]
    assert [r.blocking_seconds for r in saved] == stalls
    assert all(r.blocking_seconds <= r.save_seconds for r in saved)


def _fail_writes_from(monkeypatch, nth: int) -> None:
    real, calls = checkpointer_mod._save, []

    def failing(state, dest):
        calls.append(1)
        if len(calls) >= nth:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(state, dest)

    monkeypatch.setattr(checkpointer_mod, "_save", failing)


def test_a_background_write_that_fails_fails_the_next_step_as_a_storage_error_exit_5(
        tmp_path, monkeypatch):
    _fail_writes_from(monkeypatch, 2)
    model, opt = build()
    reached = []
    with pytest.raises(SystemExit) as stop:
        with session(tmp_path, max_steps=50, every_steps=2) as ckpt:
            ckpt.restore(model=model, optimizer=opt)
            for step in range(1, 51):
                train(model, opt, [step])
                if step == 5:  # the failed save of step 4 has ended: step 5 must say so
                    until(lambda: not ckpt._ck.in_flight, "the save of step 4 to end")
                reached.append(step)
                ckpt.step(step, loss=0.5)
    assert stop.value.code == 5 and reached[-1] == 5
    assert ckpt.repo.read_pointer().step == 2


def test_a_stop_request_and_the_final_save_wait_for_the_save_in_flight(tmp_path, monkeypatch):
    model, opt = build()
    write_gate = Gate(monkeypatch, checkpointer_mod, "_save")
    ckpt = session(tmp_path, max_steps=3, every_steps=1)
    ckpt.restore(model=model, optimizer=opt)
    train(model, opt, [1])
    ckpt.step(1, loss=0.5)
    assert write_gate.arrived.wait(DEADLINE_S)
    train(model, opt, [2])
    ckpt.stop.signal_name = "SIGTERM"  # what the handler sets
    exits: list[int] = []

    def step_to_the_stop():
        try:
            ckpt.step(2)
        except SystemExit as e:  # a stopped step exits, as the process would
            exits.append(e.code)

    stopping = threading.Thread(target=step_to_the_stop)
    stopping.start()
    stopping.join(0.5)
    assert stopping.is_alive(), "the stop did not wait for the save in flight"
    assert ckpt.repo.read_pointer().checkpoint is None
    write_gate.opened.set()
    stopping.join(DEADLINE_S)
    assert exits == [Outcome.PREEMPTED.exit_code]
    assert ckpt.stopped and ckpt.repo.read_pointer().step == 2
    assert [ckpt.repo.read_manifest(n).step for n in ckpt.repo.committed()] == [1, 2]
    ckpt.close()


def test_through_the_session_the_optimizer_is_fenced_and_its_tensors_go_through_host_buffers(
        tmp_path, monkeypatch):
    model, opt = build()
    ckpt = session(tmp_path, max_steps=10, every_steps=3)
    ckpt.restore(model=model, optimizer=opt)
    ck = ckpt._ck
    # The session wraps every part (to measure it); the checkpointer sees the optimizer behind.
    assert ck._optimizers == [opt] and ck._buffers is not None
    assert set(ck._hooks) and all(h.id in {**opt._optimizer_step_pre_hooks,
                                           **opt._optimizer_step_post_hooks} for h in ck._hooks)
    train(model, opt, [1, 2, 3])
    step_3 = {k: v.clone() for k, v in model.state_dict().items()}

    copy_gate = Gate(monkeypatch, HostBuffers, "get")
    ckpt.step(1, loss=0.5)
    ckpt.step(2, loss=0.5)
    ckpt.step(3, loss=0.5)  # a save: it returns with the optimizer's tensors still to copy
    # The first layer's weight and its AdamW moments are left to the copy worker.
    weight, moments = model[0].weight, opt.state[model[0].weight]
    deferred = {t.data_ptr() for t in ck._snapshot.sources}
    assert {t.data_ptr() for t in (weight, moments["exp_avg"], moments["exp_avg_sq"])} <= deferred
    forward_backward(model, opt, 4)
    stepped = threading.Thread(target=opt.step)
    stepped.start()
    assert copy_gate.arrived.wait(DEADLINE_S)
    stepped.join(0.5)
    assert stepped.is_alive(), "the optimizer wrote its tensors before the snapshot copied them"
    copy_gate.opened.set()
    stepped.join(DEADLINE_S)
    ckpt._ck.wait()
    assert ck._buffers.allocations > 0
    assert_bitwise_equal(committed_state(ckpt.repo)["model"], step_3)
    ckpt.close()
