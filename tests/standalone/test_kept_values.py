"""Plain values kept by name (a script's globals, an object's attributes, a tuple of
tensors) join the checkpoint in one line and come back where they live, also over an
epoch prologue that reassigns them; `epochs()` numbers epochs from a start."""

from __future__ import annotations

import pytest
import torch

from trainer.api.session import CheckpointSession


def _session(store, **kw) -> CheckpointSession:
    kw.setdefault("every_steps", 100)
    return CheckpointSession(run="r", experiment="e", store=str(store), install_signals=False,
                             heartbeat_seconds=60, **kw)


def _epochs_run(store, *, stop_after: int | None, **kw) -> tuple[dict, list[tuple[int, int]]]:
    """4 epochs of 3 batches, numbered from 1; the prologue resets `hidden`, each batch
    changes `hidden` and `lr`; leaves after `stop_after` steps (its end is committed)."""
    g = {"lr": 1.0, "best": None}
    seen: list[tuple[int, int]] = []
    with _session(store, **kw) as ckpt:
        ckpt.keep(g, "lr", "best", "hidden")
        ckpt.restore(model=torch.nn.Linear(1, 1))
        for epoch in ckpt.epochs(5, 3, start=1):
            g["hidden"] = (torch.zeros(2), torch.zeros(2))  # the epoch's prologue
            for b, item in ckpt.batches(enumerate([1.0, 2.0, 3.0])):
                h, c = g["hidden"]
                g["hidden"] = (h + 1, c + item * epoch)
                g["lr"] /= 2
                seen.append((epoch, b))
                ckpt.step()
                if ckpt.loop.step == stop_after:
                    return g, seen
            g["best"] = epoch if g["best"] is None else min(g["best"], epoch)
    return g, seen


def test_epochs_with_a_start_number_them_as_range_does_and_batches_hand_out_the_items(tmp_path):
    _, seen = _epochs_run(tmp_path, stop_after=None)
    assert seen == [(e, b) for e in range(1, 5) for b in range(3)]


def test_kept_globals_and_a_tuple_of_tensors_resume_inside_an_epoch_over_its_prologue(tmp_path):
    whole, seen_whole = _epochs_run(tmp_path / "whole", stop_after=None)
    _epochs_run(tmp_path / "cut", stop_after=7)  # inside epoch 3, after its first batch
    resumed, seen = _epochs_run(tmp_path / "cut", stop_after=None, continue_finished=True)
    assert seen == seen_whole[7:]
    assert resumed["lr"] == whole["lr"] == 2.0 ** -12 and resumed["best"] == whole["best"]
    for a, b in zip(resumed["hidden"], whole["hidden"], strict=True):
        assert torch.equal(a, b)


def test_an_objects_attributes_are_kept_by_name(tmp_path):
    class Run:
        epochs_run = 0

    first, second = Run(), Run()
    with _session(tmp_path) as ckpt:
        ckpt.keep(first, "epochs_run")
        ckpt.restore(model=torch.nn.Linear(1, 1))
        first.epochs_run = 5
        ckpt.step(1)
    with _session(tmp_path, continue_finished=True) as ckpt:
        ckpt.keep(second, "epochs_run")
        ckpt.restore(model=torch.nn.Linear(1, 1))
        assert second.epochs_run == 5
        ckpt.step(2)


@pytest.mark.parametrize("call, message", [
    (lambda ckpt: ckpt.keep({}), "names no value"),
    (lambda ckpt: ckpt.keep({}, "not a name"), "not a variable"),
    (lambda ckpt: ckpt.epochs(3, 2, start=4), "start is 4"),
])
def test_a_keep_or_epochs_call_that_cannot_work_is_bad_input(tmp_path, call, message, caplog):
    with pytest.raises(SystemExit, match="2"), _session(tmp_path) as ckpt:
        if "start" not in message:
            call(ckpt)
        ckpt.restore(model=torch.nn.Linear(1, 1))
        call(ckpt)
    assert message in caplog.text
