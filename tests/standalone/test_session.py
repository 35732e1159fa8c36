"""The own-loop API, in process: restore, triggers, stop, exit codes, lineage, bad parts."""

from __future__ import annotations

import json
import logging
import signal
import threading

import pytest
import torch

from trainer.api.session import CheckpointSession
from trainer.base.outcomes import Outcome
from trainer.checkpoints.repo import CheckpointRepo
from trainer.process.contract import LaunchEnv
from trainer.storage import open_store


def _parts(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt


def _train(model, opt, step: int) -> float:
    x = torch.full((8, 4), 0.01 * step)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def _session(store, **kw) -> CheckpointSession:
    kw.setdefault("every_steps", 5)
    kw.setdefault("heartbeat_seconds", 60)
    return CheckpointSession(run="r", experiment="e", store=str(store), install_signals=False, **kw)


def _repo(store) -> CheckpointRepo:
    return CheckpointRepo(open_store(str(store)), "e", "r")


def test_a_fresh_run_restores_to_step_zero_and_commits_every_n_steps_and_the_last(tmp_path):
    model, opt = _parts()
    with _session(tmp_path, max_steps=12) as ckpt:
        assert ckpt.restore(model=model, optimizer=opt) == 0
        for step in range(1, 13):
            assert ckpt.step(step, loss=_train(model, opt, step)) is False
    names = _repo(tmp_path).committed()
    assert [n.split("-")[1] for n in names][-3:] == ["000000005", "000000010", "000000012"]


def test_a_second_session_continues_where_the_first_stopped_with_the_same_parameters(tmp_path):
    model, opt = _parts()
    with _session(tmp_path / "a") as ckpt:
        ckpt.restore(model=model, optimizer=opt)
        for step in range(1, 21):
            ckpt.step(step, loss=_train(model, opt, step))
    model2, opt2 = _parts()
    with _session(tmp_path / "b") as ckpt:
        ckpt.restore(model=model2, optimizer=opt2)
        for step in range(1, 8):
            ckpt.step(step, loss=_train(model2, opt2, step))  # ends with a final commit at 7
    model3, opt3 = _parts(seed=99)  # different init: everything must come from the checkpoint
    # Leaving the loop at 7 ended the run there: continuing it is asked for.
    with _session(tmp_path / "b", continue_finished=True) as ckpt:
        start = ckpt.restore(model=model3, optimizer=opt3)
        assert start == 7
        for step in range(start + 1, 21):
            ckpt.step(step, loss=_train(model3, opt3, step))
    for a, b in zip(model.parameters(), model3.parameters(), strict=True):
        assert torch.equal(a, b)
    assert opt.state_dict()["state"][0]["momentum_buffer"].equal(
        opt3.state_dict()["state"][0]["momentum_buffer"])


def test_a_plain_dict_part_is_restored_in_place(tmp_path):
    model, opt = _parts()
    values = {"tokens_seen": 0, "hidden": torch.zeros(3)}
    with _session(tmp_path) as ckpt:
        ckpt.restore(model=model, values=values)
        values["tokens_seen"] = 123
        values["hidden"] = torch.arange(3.0)
        ckpt.step(5)
    mine = {"tokens_seen": -1}
    with _session(tmp_path, continue_finished=True) as ckpt:
        ckpt.restore(model=_parts()[0], values=mine)
    assert mine["tokens_seen"] == 123 and torch.equal(mine["hidden"], torch.arange(3.0))


def test_a_new_best_metric_commits_and_the_pointer_remembers_it(tmp_path):
    model, _ = _parts()
    with _session(tmp_path, every_steps=None) as ckpt:
        ckpt.restore(model=model)
        ckpt.step(1, metrics={"loss": 2.0})
        ckpt.step(2, metrics={"loss": 3.0})
        ckpt.step(3, metrics={"loss": 1.0})
    ptr = _repo(tmp_path).read_pointer()
    assert ptr.best.checkpoint.startswith("step-000000003")
    reasons = [_repo(tmp_path).read_manifest(n).meta["reason"] for n in _repo(tmp_path).committed()]
    assert reasons == ["best", "best", "final"]  # the end: step 3 again, as the block left it


def test_a_stop_request_commits_the_current_step_and_exits_143_deaf_to_a_repeated_sigterm(
        tmp_path):
    model, opt = _parts()
    ckpt = _session(tmp_path, every_steps=100)
    handler = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exc, ckpt:
            ckpt.restore(model=model, optimizer=opt)
            for step in range(1, 50):
                if step == 9:
                    ckpt.stop.signal_name = "SIGTERM"  # what the signal handler sets
                if ckpt.step(step, loss=_train(model, opt, step)):
                    break
        # A second SIGTERM (a dying parent's threads each send one) cannot end it otherwise.
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert exc.value.code == 143
    assert _repo(tmp_path).read_pointer().step == 9


@pytest.mark.parametrize("error, code", [
    (ValueError("boom"), Outcome.USER_CODE_ERROR.exit_code),
    (None, Outcome.DIVERGED.exit_code),
])
def test_leaving_the_block_with_an_error_exits_with_its_documented_code(tmp_path, error, code):
    model, _ = _parts()
    ckpt = _session(tmp_path)
    with pytest.raises(SystemExit) as exc, ckpt:
        ckpt.restore(model=model)
        if error:
            raise error
        ckpt.step(1, loss=float("nan"))
    assert exc.value.code == code


@pytest.mark.parametrize("parts, message", [
    ({"loop": {}}, "reserved"),
    ({"model": [1, 2]}, "without state_dict"),
])
def test_parts_the_session_cannot_save_are_refused_as_bad_input(tmp_path, parts, message, caplog):
    ckpt = _session(tmp_path)
    with caplog.at_level(logging.ERROR, "trainer"), pytest.raises(SystemExit) as exc, ckpt:
        ckpt.restore(**parts)
    assert exc.value.code == Outcome.BAD_INPUT.exit_code
    assert message in caplog.text


@pytest.mark.parametrize("async_save", [False, True])
def test_a_value_that_cannot_be_pickled_is_refused_at_its_save_naming_part_and_key(
        tmp_path, caplog, async_save):
    values = {"ok": 1, "nested": {"lock": threading.Lock()}}
    ckpt = _session(tmp_path, async_save=async_save)
    with caplog.at_level(logging.ERROR, "trainer"), pytest.raises(SystemExit) as exc, ckpt:
        ckpt.restore(model=_parts()[0], values=values)
        for step in range(1, 6):
            ckpt.step(step)
    assert exc.value.code == Outcome.BAD_INPUT.exit_code
    assert "part 'values', key 'nested', key 'lock' holds a lock" in caplog.text
    assert not list((tmp_path / "e" / "r" / "checkpoints").glob("step-*"))


def test_unknown_or_out_of_range_triggers_are_refused_with_the_key_named(tmp_path):
    from trainer.base.errors import ConfigError

    with pytest.raises(ConfigError, match="every_stepz"):
        _session(tmp_path, every_stepz=3)
    with pytest.raises(ConfigError, match="keep_last"):
        _session(tmp_path, keep_last=0)
    # Liveness depends on the heartbeat: it cannot be switched off.
    with pytest.raises(ConfigError, match="heartbeat_seconds"):
        _session(tmp_path, heartbeat_seconds=None)
    with pytest.raises(ConfigError, match="cannot be turned off"):
        _session(tmp_path, heartbeat_seconds=3600)


def test_resuming_from_another_runs_checkpoint_is_bad_input_and_commits_nothing(tmp_path):
    model, _ = _parts()
    other = CheckpointSession(run="other", experiment="e", store=str(tmp_path),
                              install_signals=False, heartbeat_seconds=60)
    with other:
        other.restore(model=model)
        other.step(1)
    other_uri = other.repo.uri(other.repo.read_pointer().checkpoint)
    ckpt = _session(tmp_path, resume=other_uri)
    with pytest.raises(SystemExit) as exc, ckpt:
        ckpt.restore(model=_parts()[0])
    assert exc.value.code == Outcome.BAD_INPUT.exit_code
    assert _repo(tmp_path).committed() == []


def test_the_orchestrators_run_and_store_win_over_the_scripts_own(tmp_path, monkeypatch):
    told = LaunchEnv("from-dagster", "exp", str(tmp_path / "dagster-store"), attempt=1,
                     exit_with_parent=False)
    for name, value in told.to_env().items():
        monkeypatch.setenv(name, value)
    ckpt = CheckpointSession(run="mine", store=str(tmp_path / "mine"), install_signals=False)
    assert (ckpt.run, ckpt.experiment) == ("from-dagster", "exp")
    assert ckpt.store_uri == str(tmp_path / "dagster-store")


def test_lineage_records_the_code_version_of_the_script_outside_any_repository(tmp_path):
    script = tmp_path / "code" / "train.py"
    script.parent.mkdir()
    script.write_text("print('hello')\n")
    ckpt = _session(tmp_path / "store", code_path=str(script))
    with ckpt:
        ckpt.restore(model=_parts()[0])
        ckpt.step(1)
    m = _repo(tmp_path / "store").read_manifest(_repo(tmp_path / "store").committed()[-1])
    assert m.meta["lineage"]["user_code_version"].startswith("sha256:")
    script.write_text("print('changed')\n")
    from trainer.process.code_version import code_version_of

    code_version_of.cache_clear()
    assert code_version_of(script) != m.meta["lineage"]["user_code_version"]


def test_the_config_is_stored_once_and_manifests_only_reference_it(tmp_path):
    big = {"vocab": list(range(20000))}
    ckpt = _session(tmp_path, config=big)
    with ckpt:
        ckpt.restore(model=_parts()[0])
        for step in range(1, 11):
            ckpt.step(step)
    repo = _repo(tmp_path)
    for name in repo.committed():
        raw = repo.store.read_bytes(repo.key(name, "MANIFEST.json"))
        assert len(raw) < 4000
        ref = json.loads(raw)["meta"]["config"]
        stored = repo.store.read_bytes(f"e/r/configs/{ref['sha256']}.json")
        assert json.loads(stored) == big


def test_a_session_seed_seeds_every_generator_the_session_saves(tmp_path):
    import random

    import numpy as np

    _session(tmp_path, seed=3)
    first = (random.random(), float(np.random.rand()), float(torch.rand(())))
    _session(tmp_path, seed=3)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == first


# -- a loss as a tensor, best without metrics, part sizes ---------------------------------------

@pytest.mark.filterwarnings("error::UserWarning")
def test_a_loss_and_metrics_passed_as_tensors_that_require_grad_are_taken_without_a_warning(tmp_path):
    model, opt = _parts()
    with _session(tmp_path, every_steps=2) as ckpt:
        ckpt.restore(model=model, optimizer=opt)
        for step in range(1, 5):
            loss = model(torch.ones(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            assert loss.requires_grad
            ckpt.step(step, loss=loss, metrics={"loss": loss * 2})
    assert ckpt.loop.losses[-1] == loss.item()
    assert ckpt.loop.metrics["loss"] == (loss * 2).item()


def test_a_loss_tensor_of_more_than_one_number_is_bad_input_naming_its_shape(tmp_path):
    ckpt = _session(tmp_path)
    with pytest.raises(SystemExit) as exc, ckpt:
        ckpt.restore(model=_parts()[0])
        ckpt.step(1, loss=torch.ones(3))
    assert exc.value.code == Outcome.BAD_INPUT.exit_code


def _committed(store) -> list:
    repo = _repo(store)
    return [repo.read_manifest(n) for n in repo.committed()]


def test_without_the_best_metric_in_the_metrics_the_best_checkpoint_follows_the_training_loss(tmp_path):
    losses = [3.0, 2.0, 4.0, 1.0, 5.0, 1.5]
    with _session(tmp_path, every_steps=1, keep_last=1) as ckpt:
        ckpt.restore(model=_parts()[0])
        for step, loss in enumerate(losses, 1):
            ckpt.step(step, loss=loss, metrics={"accuracy": 0.5})  # no "loss" among them
    repo = _repo(tmp_path)
    best = repo.read_pointer().best
    assert best.checkpoint.startswith("step-000000004") and best.score == 1.0
    # Retention kept the best besides the last; only commits at a new low were marked best.
    kept = {m.step: m.meta["is_best"] for m in _committed(tmp_path)}
    assert kept == {4: True, 6: False}
    assert [m.meta["reason"] for m in _committed(tmp_path)] == ["interval", "final"]


def test_once_the_metrics_name_the_best_metric_it_decides_and_the_loss_no_longer_counts(tmp_path):
    with _session(tmp_path, every_steps=1, keep_last=10) as ckpt:
        ckpt.restore(model=_parts()[0])
        ckpt.step(1, loss=0.1)  # best by the loss, for now
        ckpt.step(2, loss=5.0, metrics={"loss": 2.0})  # the metric takes over: a new best
        ckpt.step(3, loss=0.01)  # a lower training loss is not a better checkpoint now
        ckpt.step(4, loss=9.0, metrics={"loss": 3.0})
    by_step = {m.step: m.meta["is_best"] for m in _committed(tmp_path)}
    assert by_step == {1: True, 2: True, 3: False, 4: False}
    assert _repo(tmp_path).read_pointer().best.checkpoint.startswith("step-000000002")


def test_the_checkpoint_record_carries_each_parts_bytes_and_an_lbfgs_history_200_times_the_model_is_named_in_a_warning(
        tmp_path, caplog):
    from trainer.checkpoints.records import CheckpointRecord

    torch.manual_seed(0)
    model = torch.nn.Linear(30, 30)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=20, history_size=100)
    data = {}

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data["x"]), data["y"])
        loss.backward()
        return loss

    with caplog.at_level(logging.WARNING, "trainer"), _session(tmp_path, every_steps=3) as ckpt:
        ckpt.restore(model=model, optimizer=opt)
        for step in range(1, 10):
            data.update(x=torch.randn(64, 30), y=torch.randn(64, 30))  # never converges
            ckpt.step(step, loss=opt.step(closure))
    repo = _repo(tmp_path)
    m = repo.read_manifest(repo.committed()[-1])
    rec = CheckpointRecord.from_dict(CheckpointRecord.from_manifest(m, repo.uri(m.name)).to_dict())
    parts = rec.part_bytes
    assert set(parts) == {"model", "optimizer", "loop", "rng"}
    assert parts["model"] == 31 * 30 * 4
    history = len(opt.state_dict()["state"][0]["old_dirs"])
    assert history == 100 and parts["optimizer"] > 200 * parts["model"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "checkpoint part 'optimizer'" in warnings[0], warnings
    assert "history_size" in warnings[0]


def test_an_optimizer_state_the_size_of_the_model_raises_no_warning(tmp_path, caplog):
    model, opt = _parts()
    with caplog.at_level(logging.WARNING, "trainer"), _session(tmp_path, every_steps=1) as ckpt:
        ckpt.restore(model=model, optimizer=opt)
        for step in range(1, 4):
            ckpt.step(step, loss=_train(model, opt, step))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    m = _committed(tmp_path)[-1]
    assert m.meta["part_bytes"]["optimizer"] == m.meta["part_bytes"]["model"]  # momentum


# -- epochs of a hand-rolled batch loop -------------------------------------------------------

EPOCHS, PER_EPOCH = 3, 4


def _train_epochs(store, stop_at: int | None = None):
    """EPOCHS epochs of PER_EPOCH batches, each epoch shuffled with the global generator
    first (the prologue), its end-of-epoch work recorded in `ends`; a stop at `stop_at`."""
    model, opt = _parts()
    ends: list[int] = []
    ckpt = _session(store, every_steps=None, on_epoch_end=False)

    def loop():
        for epoch in ckpt.epochs(EPOCHS, PER_EPOCH):
            order = torch.randperm(PER_EPOCH)
            for b in ckpt.batches():
                loss = _train(model, opt, int(order[b]) + 10 * epoch)
                if ckpt.loop.step + 1 == stop_at:
                    ckpt.stop.signal_name = "SIGTERM"
                if ckpt.step(loss=loss):
                    return
            ends.append(epoch)

    code = 0
    try:
        with ckpt:
            ckpt.restore(model=model, optimizer=opt)
            loop()
    except SystemExit as e:
        code = e.code
    return ends, model, code


@pytest.mark.parametrize("stop_at", [PER_EPOCH * 2, PER_EPOCH + 2])
def test_epochs_and_batches_resume_a_stop_at_the_epoch_boundary_or_inside_an_epoch_exactly(
        tmp_path, stop_at):
    """At an epoch's last batch, the stop comes before that epoch's end-of-epoch work: the
    resume runs it (once). Inside an epoch, the resume replays the epoch's shuffle from the
    generators the epoch began with and continues with the next batch."""
    ends, whole, code = _train_epochs(tmp_path / "a")
    assert (ends, code) == ([0, 1, 2], 0)
    ends, _, code = _train_epochs(tmp_path / "b", stop_at=stop_at)
    assert (ends, code) == ([0], 143)
    ends, resumed, code = _train_epochs(tmp_path / "b")
    assert (ends, code) == ([1, 2], 0)
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_position_without_epochs_takes_a_checkpoint_at_an_epochs_last_batch_as_before_its_end_of_epoch_work(tmp_path):
    from trainer.api.epochs import Position

    with _session(tmp_path, every_steps=None) as ckpt:
        ckpt.restore(model=_parts()[0])
        for step in range(1, 9):
            ckpt.step(step)
    with _session(tmp_path, continue_finished=True) as again:
        assert again.restore(model=_parts()[0]) == 8
        assert again.position(4) == Position(epoch=1, batch=4, epoch_end_pending=True)
        assert again.position(3) == Position(epoch=2, batch=2, epoch_end_pending=False)
        assert again.position(8) == Position(epoch=0, batch=8, epoch_end_pending=True)
    fresh = _session(tmp_path / "fresh")
    with pytest.raises(SystemExit, match="8"), fresh:  # no step trained: exit 8, no_checkpoint
        fresh.restore(model=_parts()[0])
        assert fresh.position(4) == Position(0, 0, False)


def test_a_step_inside_epochs_without_batches_is_bad_input_before_anything_is_committed(tmp_path):
    ckpt = _session(tmp_path, every_steps=1)
    with pytest.raises(SystemExit) as exc, ckpt:
        ckpt.restore(model=_parts()[0])
        for _epoch in ckpt.epochs(2, 3):
            for _b in range(3):
                ckpt.step(loss=1.0)
    assert exc.value.code == Outcome.BAD_INPUT.exit_code
    assert _repo(tmp_path).committed() == []


def test_a_step_number_left_out_is_the_one_after_the_last(tmp_path):
    with _session(tmp_path, every_steps=None) as ckpt:
        assert ckpt.restore(model=_parts()[0]) == 0
        ckpt.step()
        ckpt.step(loss=1.0)
    assert _repo(tmp_path).read_pointer().step == 2
