"""Hostile or inconsistent input is refused by name (exit 2, no traceback), in the config
the trainer reads, in the ranks launcher's arguments, and in a manifest whose `run` was
edited to pass as another run's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.trainer_proc import ROOT
from trainer.api.session import CheckpointSession
from trainer.base.errors import CheckpointError, ConfigError
from trainer.checkpoints.repo import CheckpointRepo
from trainer.config import MAX_TASK_ARGS_DEPTH, config_from_dict
from trainer.config_file import read_config_file
from trainer.storage import open_store


def nested(levels: int) -> dict:
    top = cur = {}
    for _ in range(levels - 1):
        cur["a"] = {}
        cur = cur["a"]
    return top


HOSTILE = {
    "task_path": ({"task": "../../etc/passwd:x"}, "'task'"),
    "task_relative": ({"task": ".x:y"}, "'task'"),
    "task_no_module": ({"task": ":y"}, "'task'"),
    "device_tpu": ({"device": "tpu"}, "'device'"),
    "odd_batch": ({"batch_size": 33, "distributed": {"nproc_per_node": 2}}, "'batch_size'"),
    "deep_args": ({"task_args": nested(500)}, "'task_args'"),
}


@pytest.mark.parametrize("raw,key", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_config_the_run_would_refuse_is_refused_when_read_naming_the_key(raw, key):
    with pytest.raises(ConfigError, match=key):
        config_from_dict(raw)


def test_task_args_nested_to_the_bound_are_accepted():
    assert config_from_dict({"task_args": nested(MAX_TASK_ARGS_DEPTH)}).task_args


@pytest.mark.parametrize("body", ["null", "[]", "3", '"x"'])
def test_a_config_file_that_holds_no_mapping_is_refused_not_read_as_all_defaults(tmp_path, body):
    path = tmp_path / "cfg.json"
    path.write_text(body)
    with pytest.raises(ConfigError, match="not a mapping of config keys"):
        read_config_file(path)


def test_an_empty_yaml_file_is_refused_not_read_as_all_defaults(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="not a mapping"):
        read_config_file(path)


def _cli(args: list[str], cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300)


# `python -m trainer` in an interpreter where `import torch` fails: a config is refused
# before torch is loaded (a fraction of a second, not the 3 s of torch and Dynamo).
WITHOUT_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.argv[0] = 'trainer'; "
                 "runpy.run_module('trainer', run_name='__main__', alter_sys=True)")


@pytest.mark.slow
def test_every_hostile_config_exits_2_from_the_real_cli_before_torch_is_loaded(tmp_path):
    for name, (raw, key) in HOSTILE.items():
        cfg = tmp_path / f"{name}.json"
        cfg.write_text(json.dumps(raw))
        res = _cli(["-c", WITHOUT_TORCH, "--config", str(cfg), "--store", str(tmp_path / "s")])
        assert res.returncode == 2, (name, res.stderr[-2000:])
        assert "Traceback" not in res.stderr and key in res.stderr, (name, res.stderr[-2000:])
    assert not (tmp_path / "s").exists()  # nothing was trained or written


@pytest.mark.slow
def test_the_ranks_launcher_bounds_its_process_count_like_the_config_does():
    res = _cli(["-m", "trainer.ranks", "--nproc-per-node", "10000", "--", "true"])
    assert res.returncode == 2
    assert "pass 1 to 1024" in res.stderr and "Traceback" not in res.stderr


def _commit_one(store, run: str) -> None:
    model = torch.nn.Linear(2, 1)
    with CheckpointSession(run=run, experiment="e", store=str(store), max_steps=1,
                           install_signals=False, heartbeat_seconds=60) as ckpt:
        ckpt.restore(model=model)
        ckpt.step(1, loss=1.0)


def test_a_manifest_whose_run_was_edited_but_whose_lineage_names_another_run_is_refused(tmp_path):
    _commit_one(tmp_path, "other")
    src = tmp_path / "e" / "other" / "checkpoints"
    dst = tmp_path / "e" / "mine" / "checkpoints"
    shutil.copytree(src, dst)
    (name,) = [p.name for p in dst.iterdir() if p.name.startswith("step-")]
    manifest = dst / name / "MANIFEST.json"
    raw = json.loads(manifest.read_text())
    raw["run"] = "mine"
    manifest.write_text(json.dumps(raw))
    repo = CheckpointRepo(open_store(str(tmp_path)), "e", "mine")
    with pytest.raises(CheckpointError, match="lineage names 'other'"):
        repo.read_manifest(name)


def test_a_sharded_task_whose_optimizer_was_built_before_sharding_is_refused_saying_how():
    from trainer.api.task import Task
    from trainer.base.errors import ConfigError
    from trainer.loop import optimizer_and_scheduler

    model = torch.nn.Linear(2, 1)
    task = Task(model=model, train_data=[], loss_fn=lambda m, b: m(b).sum(),
                eval_fn=lambda m: {}, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    cfg = config_from_dict({"distributed": {"strategy": "fsdp"}})
    with pytest.raises(ConfigError, match=r"return a function of the model instead"):
        optimizer_and_scheduler(cfg, task)
    # Replicated, the same task is fine: its optimizer steps the parameters it trains.
    assert optimizer_and_scheduler(config_from_dict({}), task)[0] is task.optimizer
