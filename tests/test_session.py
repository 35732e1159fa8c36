"""The own-loop API, in process: restore, triggers, stop, exit codes, lineage, bad parts."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from trainer.contract import LaunchEnv
from trainer.outcomes import Outcome
from trainer.repo import CheckpointRepo
from trainer.session import CheckpointSession
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
    with _session(tmp_path / "b") as ckpt:
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
    with _session(tmp_path) as ckpt:
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
    assert reasons == ["best", "best"]


def test_a_stop_request_commits_the_current_step_and_exits_143(tmp_path):
    model, opt = _parts()
    ckpt = _session(tmp_path, every_steps=100)
    with pytest.raises(SystemExit) as exc, ckpt:
        ckpt.restore(model=model, optimizer=opt)
        for step in range(1, 50):
            if step == 9:
                ckpt.stop.signal_name = "SIGTERM"  # what the signal handler sets
            if ckpt.step(step, loss=_train(model, opt, step)):
                break
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


def test_unknown_or_out_of_range_triggers_are_refused_with_the_key_named(tmp_path):
    from trainer.errors import ConfigError

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
    from trainer.code_version import code_version_of

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
