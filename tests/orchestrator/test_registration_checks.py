"""A command run's config is checked at registration, before the run name is taken, as the
launch would resolve it; and a run with no committed checkpoint may be registered again
with a corrected config (the CLI's `register`, in-process; the process is in
test_cli_dagster)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import dagster as dg
import pytest

from ckpt_assets.base.names import PARTITIONS_NAME
from ckpt_assets.base.registration import (
    RegistrationConflict,
    normalize_training_config,
    read_registration,
    register_training_run,
)
from ckpt_assets.cli.main import main as cli_main
from tests.dagster_fixtures import *  # noqa: F403
from trainer.base.errors import ConfigError
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import open_store


def _project(tmp_path: Path) -> Path:
    """A user's project: a script beside the config file, and an executable launcher."""
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "train.py").write_text("print('training')\n")
    launcher = proj / "src" / "run.sh"
    launcher.write_text("#!/bin/sh\nexec python train.py\n")
    launcher.chmod(launcher.stat().st_mode | stat.S_IXUSR)
    (proj / "src" / "notes.txt").write_text("not executable\n")
    return proj


def _command(**overrides) -> dict:
    return {"command": ["python", "train.py"], "cwd": "src", "max_steps": 5, **overrides}


def _register(tmp_path: Path, capsys, name: str, config: dict) -> tuple[int, str, str]:
    """`ckpt-assets register` run from the project's directory, the config kept elsewhere."""
    path = tmp_path / "configs" / "train.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(config))
    code = cli_main(["register", name, "--config", str(path)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_relative_cwd_is_anchored_where_it_was_registered_from_and_recorded_absolute(
        tmp_path):
    proj = _project(tmp_path)
    cfg = normalize_training_config(_command(), "r1", base_dir=proj)
    assert cfg.cwd == str(proj / "src")
    # No cwd: the command runs where it was registered from.
    cfg = normalize_training_config(_command(command=["python", "src/train.py"], cwd=None),
                                    "r1", base_dir=proj)
    assert cfg.cwd == str(proj)
    absolute = normalize_training_config(_command(cwd=str(proj / "src")), "r1",
                                         base_dir=tmp_path)
    assert absolute.cwd == str(proj / "src")


@pytest.mark.parametrize("overrides,says", [
    ({"cwd": "scr"}, "proj/scr is not a directory"),
    ({"command": ["python", "trian.py"]}, "runs the script 'trian.py'"),
    ({"command": ["./missing.sh"]}, "missing.sh does not exist"),
    ({"command": ["./notes.txt"]}, "notes.txt is not executable"),
    ({"command": ["no-such-program-anywhere"]}, "'no-such-program-anywhere' is not on PATH"),
])
def test_what_the_launch_could_not_start_is_refused_at_registration_naming_it(
        tmp_path, overrides, says):
    proj = _project(tmp_path)
    with pytest.raises(ConfigError, match=says) as e:
        normalize_training_config(_command(**overrides), "r1", base_dir=proj)
    if "PATH" not in says:  # a path names the directory it was looked for in
        assert str(proj) in str(e.value)


@pytest.mark.parametrize("command", [["python", "train.py"], ["./run.sh"], ["sh", "run.sh"],
                                     [sys.executable, "-c", "pass"]])
def test_a_command_the_launch_can_start_is_accepted(tmp_path, command):
    proj = _project(tmp_path)
    assert normalize_training_config(_command(command=command), "r1", base_dir=proj).command \
        == command


def test_a_typod_cwd_is_refused_with_exit_2_then_the_corrected_config_takes_the_same_name(
        tmp_path, capsys, dagster_home, store_uri, monkeypatch):
    monkeypatch.chdir(_project(tmp_path))
    code, out, err = _register(tmp_path, capsys, "first", _command(cwd="scr"))
    assert code == 2 and "config key 'cwd'" in err and "scr is not a directory" in err
    assert err.strip().count("\n") == 0
    assert not (tmp_path / "store").exists()  # the name is not taken
    assert dg.DagsterInstance.get().get_dynamic_partitions(PARTITIONS_NAME) == []
    code, out, err = _register(tmp_path, capsys, "first", _command())
    assert code == 0, err
    assert "registered: training run first" in out
    reg = read_registration(open_store(store_uri), "first")
    assert reg is not None and reg.config.cwd == str(tmp_path / "proj" / "src")


def test_a_run_without_a_committed_checkpoint_is_registered_again_with_a_corrected_config(
        tmp_path, capsys, dagster_home, store_uri, monkeypatch):
    monkeypatch.chdir(_project(tmp_path))
    assert _register(tmp_path, capsys, "fixme", _command(max_steps=5))[0] == 0
    code, out, err = _register(tmp_path, capsys, "fixme", _command(max_steps=7))
    assert code == 0, err
    assert "re-registered" in out and "no committed checkpoint" in out
    assert "max_steps: registered 5, given 7" in out
    assert read_registration(open_store(store_uri), "fixme").config.max_steps == 7
    assert dg.DagsterInstance.get().get_dynamic_partitions(PARTITIONS_NAME) == ["fixme"]


def test_a_corrected_experiment_moves_the_registration_and_leaves_no_stale_config(tmp_path):
    store = open_store(str(tmp_path / "store"))
    register_training_run(store, "r1", {"max_steps": 5}, experiment="old")
    moved = register_training_run(store, "r1", {"max_steps": 5}, experiment="new",
                                  may_correct=True)
    assert moved.corrected and "experiment: registered 'old', given 'new'" in moved.corrected
    assert read_registration(store, "r1").experiment == "new"
    assert not (tmp_path / "store" / "old" / "r1" / "config.json").exists()


def _commit_one(store, experiment: str, run: str) -> None:
    repo = CheckpointRepo(store, experiment, run)
    repo.claim(None, at_least=1)
    pending = repo.begin(1, 1)
    with repo.write_file(pending, "model.pt") as f:
        f.write(b"weights")
    repo.commit(pending, {"step": 1})


def test_once_a_checkpoint_is_committed_the_config_is_fixed(tmp_path):
    store = open_store(str(tmp_path / "store"))
    register_training_run(store, "r1", {"max_steps": 5})
    _commit_one(store, "default", "r1")
    with pytest.raises(RegistrationConflict, match="max_steps: registered 5, given 6"):
        register_training_run(store, "r1", {"max_steps": 6}, may_correct=True)
    assert read_registration(store, "r1").config.max_steps == 5


def test_without_may_correct_a_different_config_is_still_refused(tmp_path):
    store = open_store(str(tmp_path / "store"))
    register_training_run(store, "r1", {"max_steps": 5})
    with pytest.raises(RegistrationConflict):
        register_training_run(store, "r1", {"max_steps": 6})
