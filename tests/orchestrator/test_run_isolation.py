"""One run never touches another: the orchestrator's variables are its own.

A run's config cannot set the variables that say which run a process writes (refused at
registration, exit 2, naming the key); and a registration that carries them anyway (written
by hand past the check) still trains only its own run: the orchestrator applies its values
last, and a checkpoint report for another run is never recorded as this one's.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from ckpt_assets.base.registration import (
    canonical_json,
    config_key,
    normalize_training_config,
    registry_key,
)
from ckpt_assets.definitions import make_resources
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import (
    ROOT,
    checkpoints,
    cli,
    materialize_run,
    step_failure_metadata,
)
from trainer.checkpoints.repo import CheckpointRepo
from trainer.process.contract import Env
from trainer.storage import open_store

PLAIN = str(ROOT / "examples" / "plain_script" / "train.py")


def _command(steps: int) -> dict:
    return {"command": ["python", PLAIN, "--steps", str(steps)], "max_steps": steps,
            "checkpoint": {"heartbeat_seconds": 0.5}}


@pytest.mark.slow
def test_registering_a_run_whose_env_names_the_orchestrators_variable_exits_2_naming_it(
        tmp_path, dagster_home, store_uri):
    path = tmp_path / "attack.json"
    path.write_text(json.dumps({**_command(20), "env": {Env.RUN.value: "victim"}}))
    proc = cli("register", "attacker", "--config", str(path))
    assert proc.returncode == 2, proc.stderr
    assert "CKPT_RUN" in proc.stderr and "reserved" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    listed = cli("list", "--json")
    assert "attacker" not in listed.stdout  # the name is not taken


def _register_by_hand(store_dir: str, run: str, config: dict, env: dict) -> None:
    """What a hostile or careless hand could leave in the store: a registration whose env
    names the orchestrator's variables, never checked."""
    full = {**normalize_training_config(config, run).to_dict(), "env": env}
    body = canonical_json(full)
    store = open_store(store_dir)
    store.put_new(config_key(full["experiment"], run), body)
    store.put_new(registry_key(run), canonical_json({
        "experiment": full["experiment"], "config_sha256": hashlib.sha256(body).hexdigest()}))


@pytest.mark.slow
def test_a_registration_forced_past_the_check_still_writes_only_its_own_run(
        instance, tmp_path, mlflow_uri):
    store_dir = str(tmp_path / "store")
    resources = make_resources(store_dir)
    victim = materialize_run(instance, "victim", resources, training=_command(40))
    assert victim.success, step_failure_metadata(victim)
    victim_repo = CheckpointRepo(open_store(store_dir), "default", "victim")
    before = victim_repo.read_pointer()
    victim_names = sorted(victim_repo.committed())

    _register_by_hand(store_dir, "attacker", _command(20), {
        Env.RUN.value: "victim", Env.ATTEMPT.value: "99", Env.STORE_URI.value: store_dir})
    attacker = materialize_run(instance, "attacker", resources)
    # Read back, the registration is refused as bad input naming the variable: no attempt
    # of it starts (the soak's env-override fault shows launch applying the contract last
    # to such a config).
    assert not attacker.success
    desc, md = step_failure_metadata(attacker, "training_dataset")
    assert "are reserved" in desc and md["failure_class"] == "bad_input", (desc, md)
    assert checkpoints(attacker) == []

    after = victim_repo.read_pointer()
    assert (after.checkpoint, after.generation) == (before.checkpoint, before.generation)
    assert sorted(victim_repo.committed()) == victim_names
