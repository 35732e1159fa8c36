"""A checkpoint's size, where a person looks for it: `ckpt-assets list --json` (the latest
checkpoint's bytes and each part's tensor bytes), each checkpoint observation's metadata,
and MLflow's `checkpoint_bytes` metric per committed checkpoint. Fast: nothing trains."""

from __future__ import annotations

import dagster as dg
import pytest
from mlflow.tracking import MlflowClient

from ckpt_assets.base.metadata import checkpoint_metadata
from ckpt_assets.base.registration import register_training_run
from ckpt_assets.defs.resources import MLflowResource
from ckpt_assets.mlflow.metrics import CHECKPOINT_BYTES
from ckpt_assets.mlflow.tracking import MlflowTracker
from ckpt_assets.records.listing import run_summary
from tests.dagster_fixtures import made_mlflow_db
from trainer.checkpoints.records import CheckpointRecord
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import open_store

KEY = "sized"
PARTS = {"model": 4096, "optimizer": 8192}


def _commit(repo: CheckpointRepo, step: int, payload: bytes, parent: bool = False):
    if not parent:
        repo.claim(None, at_least=1)
    pending = repo.begin(step, 1)
    with repo.write_file(pending, "model.pt") as f:
        f.write(payload)
    return repo.commit(pending, {"step": step, "loss": 1.0 / step, "part_bytes": PARTS})


def test_list_json_carries_the_latest_checkpoints_bytes_and_its_part_bytes(tmp_path):
    store = open_store(str(tmp_path / "store"))
    register_training_run(store, KEY, {"max_steps": 100})
    repo = CheckpointRepo(store, "default", KEY)
    _commit(repo, 10, b"x" * 100)
    latest = _commit(repo, 20, b"y" * 300, parent=True)
    with dg.DagsterInstance.ephemeral() as instance:
        row = run_summary(instance, store, KEY)
    assert row["latest_step"] == 20
    assert row["latest_checkpoint_bytes"] == latest.total_size
    assert latest.total_size >= 300  # the newest one's files, not the first's
    assert row["latest_part_bytes"] == PARTS


def test_a_run_without_a_checkpoint_lists_no_size(tmp_path):
    store = open_store(str(tmp_path / "store"))
    register_training_run(store, KEY, {"max_steps": 100})
    with dg.DagsterInstance.ephemeral() as instance:
        row = run_summary(instance, store, KEY)
    assert row["latest_checkpoint_bytes"] is None and row["latest_part_bytes"] is None


def _record(step: int, size: int, part_bytes: dict[str, int] | None = None) -> CheckpointRecord:
    return CheckpointRecord(name=f"step-{step}", uri=f"file:///s/step-{step}", step=step,
                            attempt=1, sha256="0" * 64, size=size, loss=0.5,
                            part_bytes=part_bytes or {})


def test_a_checkpoint_observation_carries_its_size_and_part_bytes():
    md = checkpoint_metadata(_record(10, 12345, PARTS))
    assert md["size"] == 12345
    assert md["part_bytes"].value == PARTS
    # A checkpoint whose record names no parts says so, rather than an empty mapping.
    assert checkpoint_metadata(_record(10, 1))["part_bytes"].value is None


@pytest.fixture(scope="module")
def mlflow_resource(tmp_path_factory) -> MLflowResource:
    return MLflowResource(tracking_uri=made_mlflow_db(tmp_path_factory.mktemp("mlflow")
                                                      / "mlflow.db"))


def test_mlflow_records_checkpoint_bytes_once_per_committed_checkpoint(mlflow_resource):
    t = MlflowTracker(mlflow_resource, "exp", KEY)
    assert t.start({"attempt": 1})
    for step, size in [(10, 1000), (20, 1500), (20, 1500), (30, 2100)]:
        t.on_checkpoint(_record(step, size))
    hist = MlflowClient(tracking_uri=mlflow_resource.resolved_tracking_uri).get_metric_history(
        t.run_id, CHECKPOINT_BYTES)
    assert sorted((m.step, m.value) for m in hist) == [(10, 1000.0), (20, 1500.0),
                                                       (30, 2100.0)]


@pytest.mark.parametrize(("told", "goal"), [(150, 150), (None, None)])
def test_list_shows_the_step_count_the_script_trains_to_when_the_config_omits_it(
        tmp_path, told, goal):
    """One step count: a command's script says its own `max_steps` (the session writes it
    into every manifest), and `list` shows that; an open-ended script's goal is unknown, never
    the config's default, which no command is handed."""
    store = open_store(str(tmp_path / "store"))
    register_training_run(store, KEY, {"command": ["python", "train.py"]})
    with dg.DagsterInstance.ephemeral() as instance:
        assert run_summary(instance, store, KEY)["max_steps"] is None  # nothing committed
        repo = CheckpointRepo(store, "default", KEY)
        repo.claim(None, at_least=1)
        pending = repo.begin(20, 1)
        with repo.write_file(pending, "state.pt") as f:
            f.write(b"state")
        repo.commit(pending, {"max_steps": told})
        assert run_summary(instance, store, KEY)["max_steps"] == goal


def test_list_shows_a_tasks_step_count_from_its_config(tmp_path):
    store = open_store(str(tmp_path / "store"))
    register_training_run(store, KEY, {"max_steps": 70})
    with dg.DagsterInstance.ephemeral() as instance:
        assert run_summary(instance, store, KEY)["max_steps"] == 70


def test_the_session_records_the_scripts_own_step_count_in_each_manifest(tmp_path):
    import torch

    from trainer.api.session import CheckpointSession

    model = torch.nn.Linear(2, 1)
    ckpt = CheckpointSession(run="counted", store=str(tmp_path / "s"), max_steps=3,
                             every_steps=1, install_signals=False)
    with ckpt:
        start = ckpt.restore(model=model)
        for step in range(start + 1, 4):
            ckpt.step(step, loss=1.0 / step)
    repo = CheckpointRepo(open_store(str(tmp_path / "s")), "default", "counted")
    assert {repo.read_manifest(n).meta["max_steps"] for n in repo.committed()} == {3}
