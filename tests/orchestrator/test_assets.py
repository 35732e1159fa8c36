"""The three assets through `materialize()` on an ephemeral instance, with the real trainer
as a Pipes subprocess, on the local store and on a real S3 server (moto_server)."""

from __future__ import annotations

import math
import signal

import dagster as dg
import pytest
import torch

from ckpt_assets.base.end import FAILURE_METADATA_KEYS
from ckpt_assets.base.metadata import CHECKPOINT_METADATA_KEYS
from ckpt_assets.definitions import make_resources
from ckpt_assets.defs.io_managers import VersionedRepo
from ckpt_assets.defs.resources import CheckpointStore, git_commit
from ckpt_assets.lifecycle.settings import Setting
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import (
    check_results,
    checkpoints,
    materializations,
    materialize_run,
    observations,
    step_failure_metadata,
    training_config,
)
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import open_store
from trainer.tasks.toy import MLP, make_dataset

CORE_FAILURE_KEYS = ("exit_code", "failure_class", "last_committed_step", "checkpoint_uri",
                     "attempt", "training_run")


def _assert_trained_run(result, store_uri: str, key: str, experiment: str, max_steps: int):
    assert result.success
    run_id = result.run_id
    data_version = materializations(result, "training_dataset")[0]["data_version"]
    per_checkpoint = checkpoints(result)
    assert per_checkpoint, "every committed checkpoint is an observation"
    # One materialization, of the finished run: checkpoints never make the partition "done".
    (final,) = materializations(result, "model_checkpoint")
    steps = [m["step"] for m in per_checkpoint]
    assert steps == sorted(set(steps)) and steps[-1] == max_steps
    for prev, m in zip([None, *per_checkpoint], per_checkpoint, strict=False):
        assert set(CHECKPOINT_METADATA_KEYS) <= set(m), set(CHECKPOINT_METADATA_KEYS) - set(m)
        assert m["experiment"] == experiment and m["training_run"] == key
        assert m["dagster_run_id"] == run_id and m["root_run_id"] == run_id
        assert m["attempt"] == 1 and m["resumed_from_step"] is None
        assert m["data_version"] == data_version
        assert m["code_version"] == git_commit()
        assert m["parent"] == (prev["name"] if prev else None) == m["parent_checkpoint"]
        assert m["uri"].startswith(open_store(store_uri).uri) and len(m["sha256"]) == 64
        assert m["size"] > 0 and m["save_seconds"] >= 0 and math.isfinite(m["loss"])
    assert final["step"] == max_steps and final["uri"] == per_checkpoint[-1]["uri"]
    assert final["data_version"] == data_version
    # The attempt's end is recorded with the failure contract's keys, also on success.
    (ended,) = observations(result, "model_checkpoint", "attempt_ended")
    assert set(FAILURE_METADATA_KEYS) <= set(ended)
    assert {k: ended[k] for k in CORE_FAILURE_KEYS} == {
        "exit_code": 0, "failure_class": "success", "last_committed_step": max_steps,
        "checkpoint_uri": final["uri"], "attempt": 1, "training_run": key}
    assert check_results(result) == {"latest_checkpoint_verifies": True,
                                     "latest_checkpoint_loss_is_finite": True,
                                     "training_run_state": True,
                                     "final_model_meets_eval_loss_threshold": True}
    return final, materializations(result, "final_model")[0]


def _assert_exported_model_reproduces_eval(store_uri, key, experiment, fm_meta, config):
    value, manifest = VersionedRepo(open_store(store_uri), experiment, key, "models").load_current()
    assert manifest.meta["filename"] == "model.pt"
    args = config["task_args"]
    data = make_dataset(n_train=args["n_train"], n_eval=args["n_eval"])
    model = MLP(data["x_train"].shape[1], args["hidden"], 4, 0.1)
    model.load_state_dict(value["model"])
    model.eval()
    with torch.no_grad():
        loss = float(torch.nn.functional.cross_entropy(model(data["x_eval"]), data["y_eval"]))
    assert loss == pytest.approx(fm_meta["eval_loss"], abs=1e-6)
    # ... and the trainer's own eval of the same weights, recorded in the final checkpoint.
    assert fm_meta["eval_loss"] == pytest.approx(fm_meta["recorded_eval_loss"], abs=1e-6)
    assert value["step"] == config["max_steps"] and value["eval"]["loss"] == fm_meta["eval_loss"]


@pytest.mark.slow
def test_a_new_partition_trains_end_to_end_on_the_local_store_with_lineage_metadata(
        instance, tmp_path, mlflow_uri):
    store = str(tmp_path / "store")
    cfg = training_config()
    res = materialize_run(instance, "local-run", make_resources(
        store, tracking_uri=mlflow_uri), training=cfg, experiment="exp")
    final, fm = _assert_trained_run(res, store, "local-run", "exp", cfg["max_steps"])
    _assert_exported_model_reproduces_eval(store, "local-run", "exp", fm, cfg)
    # Generated data is one version to final_model, whichever way the lineage names it.
    said = [e.user_message for e in instance.all_logs(res.run_id) if e.step_key == "final_model"]
    assert not [m for m in said if "data version" in m], said
    # The run's config was registered once, where the design says.
    assert (tmp_path / "store" / "exp" / "local-run" / "config.json").exists()
    # The instance knows the partition's checkpoints (what the UI shows), and that it is done.
    flt = dg.AssetRecordsFilter(asset_key=dg.AssetKey("model_checkpoint"),
                                asset_partitions=["local-run"])
    recs = instance.fetch_observations(flt, limit=100).records
    assert sum(r.event_log_entry.asset_observation.metadata["event"].value == "checkpoint"
               for r in recs) == len(checkpoints(res))
    assert len(instance.fetch_materializations(flt, limit=100).records) == 1


@pytest.mark.slow
def test_a_new_partition_trains_end_to_end_on_s3_served_by_moto(instance, s3_env, tmp_path, mlflow_uri):
    store = s3_env["uri"]
    cfg = training_config()
    s3 = CheckpointStore(uri=store, endpoint_url=dg.EnvVar("AWS_ENDPOINT_URL"),
                         region_name="us-east-1",
                         aws_access_key_id=dg.EnvVar("AWS_ACCESS_KEY_ID"),
                         aws_secret_access_key=dg.EnvVar("AWS_SECRET_ACCESS_KEY"))
    res = materialize_run(instance, "s3-run", make_resources(
        store=s3, tracking_uri=mlflow_uri), training=cfg)
    final, fm = _assert_trained_run(res, store, "s3-run", "default", cfg["max_steps"])
    assert final["uri"].startswith(f"s3://{s3_env['bucket']}/ckpts/default/s3-run/checkpoints/")
    _assert_exported_model_reproduces_eval(store, "s3-run", "default", fm, cfg)
    import boto3

    keys = {o["Key"] for o in boto3.client("s3").list_objects_v2(
        Bucket=s3_env["bucket"])["Contents"]}
    assert "ckpts/default/s3-run/config.json" in keys
    assert "ckpts/default/s3-run/models/v-000001/MANIFEST.json" in keys


@pytest.mark.slow
def test_later_attempts_read_the_registered_config_and_continue_from_the_latest_checkpoint(
        instance, tmp_path, mlflow_uri):
    store = str(tmp_path / "store")
    res = make_resources(store, tracking_uri=mlflow_uri)
    # The config may ride on any of the run's training ops (here the second one).
    first = materialize_run(instance, "again", res, training=training_config(max_steps=20),
                            config_op="model_checkpoint")
    assert first.success
    # No config this time: the registered one is used; the finished run stays finished.
    second = materialize_run(instance, "again", res, with_checks=False)
    assert second.success
    (ended,) = observations(second, "model_checkpoint", "attempt_ended")
    # Already finished: the trainer loads nothing and trains nothing.
    assert ended["attempt"] == 2 and ended["resumed_from_step"] is None
    assert ended["last_committed_step"] == 20 and ended["checkpoints_this_attempt"] == 0
    # A different config for a registered run is refused before anything trains.
    third = materialize_run(instance, "again", res, training=training_config(max_steps=21),
                            with_checks=False)
    assert not third.success
    desc, md = step_failure_metadata(third, "training_dataset")
    assert md["exit_code"] == 2 and md["failure_class"] == "bad_input"
    assert "already registered with a different config" in desc


def test_a_run_without_a_registered_config_fails_with_what_to_do(instance, tmp_path, mlflow_uri):
    res = materialize_run(instance, "never-registered", make_resources(
        str(tmp_path / "store"), tracking_uri=mlflow_uri))
    assert not res.success
    desc, md = step_failure_metadata(res, "training_dataset")
    assert "has no registered config" in desc and "python -m ckpt_assets register" in desc
    assert md["failure_class"] == "bad_input" and md["training_run"] == "never-registered"


@pytest.mark.slow
@pytest.mark.parametrize("fault,exit_code,failure_class", [
    ({"fail_at_step": 15}, 1, "user_code_error"),
    ({"nan_at_step": 15}, 4, "diverged"),
    ({"crash_at_step": 15}, -signal.SIGKILL, "killed_by_signal"),
])
def test_a_failed_trainer_raises_failure_with_the_metadata_contract_the_resume_sensor_reads(
        instance, tmp_path, mlflow_uri, fault, exit_code, failure_class, monkeypatch):
    # What the sensors read is the point: a killed trainer's step must fail, not be
    # relaunched in its run (the default, tests/orchestrator/test_in_run_relaunch.py).
    monkeypatch.setenv(Setting.IN_RUN_RELAUNCH, "0")
    store = str(tmp_path / "store")
    cfg = training_config(task_args=fault)
    res = materialize_run(instance, "broken", make_resources(
        store, tracking_uri=mlflow_uri), training=cfg)
    assert not res.success
    desc, md = step_failure_metadata(res)
    assert set(FAILURE_METADATA_KEYS) <= set(md)
    assert md["exit_code"] == exit_code and md["failure_class"] == failure_class
    assert md["attempt"] == 1 and md["training_run"] == "broken"
    # Step 10 was committed before the fault at step 15 (checkpoints every 10 steps).
    repo = CheckpointRepo(open_store(store), "default", "broken")
    assert md["last_committed_step"] == repo.read_pointer().step >= 8
    assert md["checkpoint_uri"] == repo.uri(repo.read_pointer().checkpoint)
    assert f"exited {exit_code}" in desc and failure_class in desc
    if exit_code < 0:
        assert md["signal"] == "SIGKILL"
    # final_model did not run, and the checkpoints committed on the way (observations) do
    # not make the partition look done: nothing materialized it.
    assert not materializations(res, "final_model")
    # (A failed step's events are in the instance, not all in its result.)
    flt = dg.AssetRecordsFilter(asset_key=dg.AssetKey("model_checkpoint"),
                                asset_partitions=["broken"])
    assert instance.fetch_observations(flt, limit=1).records
    assert not instance.fetch_materializations(flt, limit=1).records


@pytest.mark.slow
def test_the_final_model_falls_back_to_the_newest_checkpoint_that_verifies(instance, tmp_path, mlflow_uri):
    store = str(tmp_path / "store")
    res = make_resources(store, tracking_uri=mlflow_uri)
    assert materialize_run(instance, "fb", res, training=training_config(max_steps=30)).success
    repo = CheckpointRepo(open_store(store), "default", "fb")
    newest = repo.read_pointer().checkpoint
    state = tmp_path / "store" / "default" / "fb" / "checkpoints" / newest / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 3] ^= 0xFF
    state.write_bytes(bytes(data))
    from ckpt_assets.defs.checks import latest_checkpoint_verifies

    again = materialize_run(instance, "fb", res, selection=dg.AssetSelection.assets(
        "final_model") | dg.AssetSelection.checks(latest_checkpoint_verifies))
    assert again.success
    (fm,) = materializations(again, "final_model")
    assert fm["step"] < 30 and fm["fallback_skipped"][0]["checkpoint"] == newest
    assert check_results(again)["latest_checkpoint_verifies"] is False
