"""Partition keys and run registration: validated names, config recorded once, no half-
registered run on bad input (the CLI's `register` entry point, run in-process)."""

from __future__ import annotations

import json

import dagster as dg
import pytest

from ckpt_assets.base.names import PARTITIONS_NAME
from ckpt_assets.base.registration import (
    RegistrationConflict,
    read_registration,
    register_training_run,
    validate_partition_key,
)
from ckpt_assets.cli.main import main as cli_main
from ckpt_assets.defs.partitions import training_runs
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import training_config
from trainer.base.errors import ConfigError, InvalidNameError
from trainer.storage import NAME_RULE, open_store

BAD_KEYS = ["", "Upper", "../escape", "a/b", "-dash-first", ".hidden", "x" * 65, "a..b",
            "sp ace", "é"]


def test_training_runs_is_the_dynamic_partitions_definition_named_in_the_design():
    assert isinstance(training_runs, dg.DynamicPartitionsDefinition)
    assert training_runs.name == PARTITIONS_NAME == "training_runs"


@pytest.mark.parametrize("key", BAD_KEYS)
def test_a_partition_key_outside_the_name_rule_is_refused_with_a_message_naming_the_rule(key):
    with pytest.raises(InvalidNameError) as e:
        validate_partition_key(key)
    assert NAME_RULE in str(e.value)


@pytest.mark.parametrize("key", ["r1", "resnet-lr3e-4", "a.b_c-d", "9lives", "x" * 64])
def test_a_partition_key_inside_the_name_rule_is_accepted(key):
    assert validate_partition_key(key) == key


def test_registration_records_the_normalized_config_once_and_forces_the_run_name(tmp_path):
    store = open_store(str(tmp_path / "store"))
    reg = register_training_run(store, "r1", training_config(run="r1"), experiment="exp")
    assert reg.created
    assert reg.config.run == "r1" and reg.config.experiment == "exp"
    on_disk = json.loads((tmp_path / "store" / "exp" / "r1" / "config.json").read_text())
    assert on_disk == reg.config.to_dict()
    # Defaults are filled in, so the same config written differently is the same config.
    assert on_disk["seed"] == 0 and on_disk["optim"]["lr"] > 0
    again = register_training_run(store, "r1", {**training_config(), "seed": 0}, "exp")
    assert not again.created and again.config == reg.config
    assert read_registration(store, "r1") == again


def test_registering_a_different_config_is_refused_and_the_registered_one_stays(tmp_path):
    store = open_store(str(tmp_path / "store"))
    register_training_run(store, "r1", training_config())
    before = (tmp_path / "store" / "default" / "r1" / "config.json").read_bytes()
    with pytest.raises(RegistrationConflict, match=r"max_steps: registered 40, given 41"):
        register_training_run(store, "r1", training_config(max_steps=41))
    with pytest.raises(RegistrationConflict, match="already registered in experiment 'default'"):
        register_training_run(store, "r1", training_config(), experiment="other")
    assert (tmp_path / "store" / "default" / "r1" / "config.json").read_bytes() == before
    assert not (tmp_path / "store" / "other").exists()


def test_a_registration_cut_off_after_config_json_is_completed_by_registering_again(tmp_path):
    store = open_store(str(tmp_path / "store"))
    reg = register_training_run(store, "r1", training_config())
    # Simulate the cut: the registry entry (second write) never happened.
    (tmp_path / "store" / "REGISTRY" / "r1.json").unlink()
    assert read_registration(store, "r1") is None
    with pytest.raises(RegistrationConflict):
        register_training_run(store, "r1", training_config(max_steps=99))
    assert read_registration(store, "r1") is None
    # A correction (the CLI's) finds no registration to correct: still refused.
    with pytest.raises(RegistrationConflict):
        register_training_run(store, "r1", training_config(max_steps=99), may_correct=True)
    done = register_training_run(store, "r1", training_config())
    assert done.config == reg.config and read_registration(store, "r1") == done


def test_a_config_the_trainer_would_reject_is_refused_before_anything_is_written(tmp_path):
    store = open_store(str(tmp_path / "store"))
    for bad, msg in [({"max_stepz": 3}, "unknown config key"),
                     ({"max_steps": 0}, "max_steps"),
                     ({"command": []}, "'command' must be a non-empty list"),
                     ({"optim": {"lr": -0.1}}, "'optim.lr' must be positive"),
                     ({"task": "no.such.module:build"}, "cannot import module"),
                     ({"task": "os:system"}, "not a Python function"),
                     ({"optim": {"lr": float("nan")}}, "finite number"),
                     ({"checkpoint": {"heartbeat_seconds": None}}, "heartbeat_seconds"),
                     ({"run": "other"}, "names run 'other'")]:
        with pytest.raises(ConfigError, match=msg):
            register_training_run(store, "r1", bad)
    assert not (tmp_path / "store").exists()


def test_a_task_its_module_defines_is_registered_without_importing_it_and_a_typo_is_refused(
        tmp_path, monkeypatch):
    """Importing a task module imports torch: seconds of every launch. Its source says
    whether the function is there; a name it does not define is imported and refused."""
    pkg = tmp_path / "user_tasks"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "heavy.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n"
                                  "def build(args):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    store = open_store(str(tmp_path / "store"))
    reg = register_training_run(store, "r1", training_config(task="user_tasks.heavy:build"))
    assert reg.config.task == "user_tasks.heavy:build"
    assert not (tmp_path / "imported").exists()
    with pytest.raises(ConfigError, match="has no function 'biuld'"):
        register_training_run(store, "r2", training_config(task="user_tasks.heavy:biuld"))
    assert read_registration(store, "r2") is None


# -- the CLI's register command, in-process (the subprocess is in test_cli_dagster) ---------

def _partitions() -> list[str]:
    return dg.DagsterInstance.get().get_dynamic_partitions(PARTITIONS_NAME)


def _register(tmp_path, capsys, name: str, config: dict | str, *extra: str):
    path = tmp_path / "cfg.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    capsys.readouterr()  # only the command's own output: not what a fixture set up just now wrote
    code = cli_main(["register", name, "--config", str(path), *extra])
    return code, capsys.readouterr()


def test_cli_register_adds_the_partition_after_writing_the_config(tmp_path, capsys,
                                                                  dagster_home, store_uri):
    code, out = _register(tmp_path, capsys, "good-run", training_config())
    assert code == 0, out.err
    assert "registered: training run good-run" in out.out
    assert _partitions() == ["good-run"]
    assert (tmp_path / "store" / "default" / "good-run" / "config.json").exists()


@pytest.mark.parametrize("case", ["invalid name", "rejected config", "unparsable config",
                                  "unreachable store",
                                  pytest.param("bucket missing", marks=pytest.mark.slow)])
def test_cli_bad_input_gets_one_clear_line_and_leaves_no_half_registered_run(
        case, tmp_path, capsys, dagster_home, store_uri, request):
    name, config, extra, code_want, says = "ok-run", training_config(), [], (2,), None
    if case == "invalid name":
        name, says = "../Evil", NAME_RULE
    elif case == "rejected config":
        config, says = training_config(batch_size=0), "batch_size"
    elif case == "unparsable config":
        config, says = "{not json", "is not valid JSON"
    elif case == "unreachable store":
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        extra, code_want, says = ["--store", str(blocker / "store")], (2, 5), "Not a directory"
    else:
        s3 = request.getfixturevalue("s3_env")
        extra, code_want, says = ["--store", f"s3://{s3['bucket']}-missing/x"], (2, 5), "does not exist"
    code, out = _register(tmp_path, capsys, name, config, *extra)
    err = out.err.strip()
    assert code in code_want, err  # 2 bad input, 5 store unavailable (trainer's classes)
    assert err.startswith("ckpt-assets: error: ") and says in err
    assert len(err.splitlines()) == 1, err
    assert _partitions() == []
    assert not list(tmp_path.rglob("config.json"))
    assert not list(tmp_path.rglob("REGISTRY"))
