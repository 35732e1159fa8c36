"""Another world size for one launch of a registered run: its config is the record and stays
as registered; the launch's world tags change the ranks for that run and every resume of it,
checked as the registration was. Fast: no process trains."""

from __future__ import annotations

import json
import time

import dagster as dg
import pytest

from ckpt_assets.base.registration import read_registration, register_training_run
from ckpt_assets.base.tags import TAG_NNODES, TAG_NPROC_PER_NODE
from ckpt_assets.base.view import RunView
from ckpt_assets.lifecycle.decision import resume_request
from ckpt_assets.lifecycle.decision_record import DecisionRecord
from ckpt_assets.lifecycle.rerun import rerun_tags
from ckpt_assets.runs.world import at_world
from tests import dagster_runs
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import training_config
from trainer.base.errors import ConfigError
from trainer.storage import open_store

KEY = "elastic"
TWO = {"distributed": {"nproc_per_node": 2}, "batch_size": 32}


@pytest.fixture
def reg(tmp_path):
    return register_training_run(open_store(str(tmp_path / "store")), KEY, TWO)


def test_a_launch_at_another_world_size_changes_only_the_ranks_of_the_registered_run(reg):
    one = at_world(reg, {"nproc_per_node": "1", "nnodes": "2"})
    assert (one.config.distributed.nproc_per_node, one.config.distributed.nnodes) == (1, 2)
    assert one.config.model_copy(update={"distributed": reg.config.distributed}) == reg.config
    assert (one.config_uri, one.config_sha256) == (reg.config_uri, reg.config_sha256)
    assert at_world(reg, {}) is reg


@pytest.mark.parametrize(("world", "says"), [
    ({"nproc_per_node": "3"}, "config key 'batch_size' is 32, which does not split evenly"),
    ({"nproc_per_node": "two"}, "distributed.nproc_per_node for this launch is 'two': pass a "
                                "whole number"),
    ({"nnodes": "0"}, "--nnodes 0: .*nnodes.*pass a world size it allows"),
])
def test_a_world_size_the_run_would_refuse_is_refused_naming_what_to_pass(reg, world, says):
    with pytest.raises(ConfigError, match=says):
        at_world(reg, world)


def _decision(run: dg.DagsterRun) -> DecisionRecord:
    return DecisionRecord(run.run_id, KEY, True, "killed", "killed", "resumed at once",
                          time.time(), None, "", 1, None)


def test_a_resume_and_a_rerun_by_hand_carry_the_world_size_their_failed_run_was_launched_at():
    world = {TAG_NPROC_PER_NODE: "1", TAG_NNODES: "2"}
    with dg.DagsterInstance.ephemeral() as instance:
        failed = dagster_runs.lost_worker_run(instance, KEY, tags=world)
        assert RunView.of(failed).world == {"nproc_per_node": "1", "nnodes": "2"}
        request = resume_request(failed, _decision(failed), None)
        assert {k: request.tags[k] for k in world} == world
        assert {k: rerun_tags(instance, KEY)[k] for k in world} == world
        plain = dagster_runs.lost_worker_run(instance, "rigid")
        assert not set(world) & set(resume_request(plain, _decision(plain), None).tags)


def test_the_cli_refuses_a_world_size_the_config_does_not_split_over_and_queues_nothing(
        tmp_path, dagster_home, store_uri, capsys):
    from ckpt_assets.cli.main import main as cli_main

    config = tmp_path / "train.json"
    config.write_text(json.dumps(training_config(**TWO)))
    assert cli_main(["launch", KEY, "--config", str(config), "--nproc-per-node", "3"]) == 2
    assert "does not split evenly over 3 ranks" in capsys.readouterr().err
    assert read_registration(open_store(store_uri), KEY) is None  # bad input creates nothing
    assert cli_main(["launch", KEY, "--tag", f"{TAG_NPROC_PER_NODE}=1"]) == 2
    assert "pass --nproc-per-node instead" in capsys.readouterr().err
    assert dg.DagsterInstance.get().get_runs() == []


def test_the_world_size_checked_is_the_chains_with_the_flags_change(reg):
    from argparse import Namespace

    from ckpt_assets.cli.main import _world_tags

    chain = {TAG_NPROC_PER_NODE: "4"}  # carried from the failed run: 32 splits over 4
    assert _world_tags(Namespace(nproc_per_node=None, nnodes=None), reg, chain) == chain
    with pytest.raises(ConfigError, match="--nnodes 3: .*does not split evenly over 12 ranks"):
        _world_tags(Namespace(nproc_per_node=None, nnodes=3), reg, chain)
    assert _world_tags(Namespace(nproc_per_node=1, nnodes=None), reg, chain) == \
        {TAG_NPROC_PER_NODE: "1"}


def test_a_command_whose_launch_names_one_rank_starts_under_the_ranks_launcher_a_task_does_not(
        tmp_path):
    from types import SimpleNamespace

    from ckpt_assets.attempt.command import under_ranks
    from trainer.process.contract import RANKS_LAUNCHER

    settings = SimpleNamespace(python="python", grace_period_seconds=20)
    store = open_store(str(tmp_path / "store"))
    command = register_training_run(store, "cmd", {"command": ["python", "train.py"]})
    task = register_training_run(store, "task", {})
    argv = ["python", "train.py"]
    assert under_ranks(command, settings, argv) == argv  # nothing asked: as registered
    one = under_ranks(at_world(command, {"nproc_per_node": "1"}), settings, argv)
    assert one[:3] == ["python", "-m", RANKS_LAUNCHER] and one[-3:] == ["--", *argv]
    assert "--nproc-per-node" in one and one[one.index("--nproc-per-node") + 1] == "1"
    assert under_ranks(at_world(task, {"nproc_per_node": "1"}), settings, argv) == argv
