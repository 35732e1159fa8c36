"""A trainer that shares no filesystem with Dagster: Pipes context and messages through S3
(a real moto_server), the dataset by s3:// URI, checkpoints in S3, the trainer in a working
directory and TMPDIR of its own. Trained through `materialize()`, then SIGKILLed and resumed
bitwise identically."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import boto3
import dagster as dg
import pytest
from dagster_pipes import (
    DAGSTER_PIPES_CONTEXT_ENV_VAR,
    DAGSTER_PIPES_MESSAGES_ENV_VAR,
    decode_param,
)

import ckpt_assets.attempt.process as trainer_process
from ckpt_assets.attempt.warm_start import WarmTrainer
from ckpt_assets.base.events import CHECKPOINT
from ckpt_assets.definitions import make_resources
from ckpt_assets.defs.resources import CheckpointStore, TrainerResource
from ckpt_assets.lifecycle.settings import Setting
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import checkpoints, materializations, materialize_run, training_config
from tests.polling import WaitTimeout, wait_for
from tests.s3_state import final_state_s3
from tests.trainer_proc import assert_bitwise_equal, final_state, run_trainer, training_state
from trainer.checkpoints.repo import CheckpointRepo
from trainer.process.contract import CHECKPOINT_MESSAGE, Finished, PipesS3Params, Started
from trainer.storage import open_store
from trainer.tasks.toy import write_dataset

pytestmark = pytest.mark.slow

PIPES_PREFIX = "pipes-io"


@pytest.fixture
def remote(s3_env, tmp_path, monkeypatch):
    """An S3 dataset, and the resources of a trainer that sees only S3: its own cwd and
    TMPDIR, Pipes over S3. Records every attempt the run worker starts (argv, env, cwd), cold
    or by handing it to a standby."""
    bucket = s3_env["bucket"]
    local = tmp_path / "toy.pt"
    write_dataset(local, n_train=256, n_eval=128)
    boto3.client("s3").upload_file(str(local), bucket, "data/toy.pt")
    local.unlink()
    started: list[dict] = []
    real_start, real_take = trainer_process.start_process, WarmTrainer.take

    def spy(argv, env, cwd, output):
        started.append({"argv": argv, "env": dict(env), "cwd": cwd})
        return real_start(argv, env, cwd, output)

    def spy_take(self, argv, env, cwd, output):  # the attempt a standby becomes
        proc = real_take(self, argv, env, cwd, output)
        if proc is not None:
            started.append({"argv": argv, "env": dict(env), "cwd": cwd})
        return proc

    monkeypatch.setattr(trainer_process, "start_process", spy)
    monkeypatch.setattr(WarmTrainer, "take", spy_take)
    home = tmp_path / "trainer-machine"
    (home / "tmp").mkdir(parents=True)
    store = CheckpointStore(uri=s3_env["uri"], endpoint_url=dg.EnvVar("AWS_ENDPOINT_URL"))
    trainer = TrainerResource(pipes="s3", pipes_s3_uri=f"s3://{bucket}/{PIPES_PREFIX}",
                              pipes_s3_interval_seconds=0.5, working_directory=str(home),
                              extra_env={"TMPDIR": str(home / "tmp")})
    return {"bucket": bucket, "dataset": f"s3://{bucket}/data/toy.pt", "store": store,
            "trainer": trainer, "started": started, "home": home, "uri": s3_env["uri"]}


def _pipes_messages(bucket: str) -> list[dict]:
    """The custom messages the trainer uploaded under the Pipes prefix, in order (its
    numbered message chunks; while the session is open, the context lies there too)."""
    s3 = boto3.client("s3")
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{PIPES_PREFIX}/") for o in page.get("Contents", [])]
    keys = [k for k in keys if k.rsplit("/", 1)[1].split(".")[0].isdigit()]
    keys.sort(key=lambda k: (k.rsplit("/", 1)[0], int(k.rsplit("/", 1)[1].split(".")[0])))
    out = []
    for key in keys:
        for line in s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode().splitlines():
            msg = json.loads(line)
            if msg.get("method") == "report_custom_message":
                out.append(msg["params"]["payload"])
    return out


def _assert_launched_without_local_files(launch: dict, home: Path) -> None:
    """The trainer was told S3 locations only: no Pipes path or config file on the run
    worker's disk."""
    for var in (DAGSTER_PIPES_CONTEXT_ENV_VAR, DAGSTER_PIPES_MESSAGES_ENV_VAR):
        params = decode_param(launch["env"][var])
        assert "path" not in params, params
        assert params["bucket"] and PipesS3Params.from_params(params) is not None, params
    assert launch["cwd"] == str(home) and launch["env"]["TMPDIR"] == str(home / "tmp")
    config = launch["argv"][launch["argv"].index("--config") + 1]
    assert config.startswith("s3://"), "the registered config is read from the store"


def test_a_trainer_reached_only_through_s3_trains_reports_and_materializes_the_final_model(
        remote, instance, mlflow_uri):
    cfg = training_config(dataset=remote["dataset"], max_steps=30)
    res = materialize_run(instance, "remote", make_resources(
        store=remote["store"], trainer=remote["trainer"], tracking_uri=mlflow_uri),
        training=cfg)
    assert res.success
    (launch,) = remote["started"]
    _assert_launched_without_local_files(launch, remote["home"])
    # What the trainer sent went through S3 ...
    sent = _pipes_messages(remote["bucket"])
    kinds = [m["type"] for m in sent]
    assert kinds[0] == Started.TYPE and kinds[-1] == Finished.TYPE, kinds
    sent_steps = [m["step"] for m in sent if m["type"] == CHECKPOINT_MESSAGE]
    # ... and arrived as Dagster events: every checkpoint reported, none recovered late.
    seen = checkpoints(res)
    assert [m["step"] for m in seen] == sent_steps and sent_steps[-1] == 30
    assert not any(m.get("recorded_late") for m in seen)
    assert all(m["uri"].startswith(f"{remote['uri']}/default/remote/") for m in seen)
    (final,) = materializations(res, "final_model")
    assert final  # the final model, from the checkpoint store on S3
    logs = [e.user_message for e in instance.all_logs(res.run_id)]
    assert any("attempt 1 started from scratch" in m for m in logs)


def _observed_checkpoints(instance, run_id: str) -> list[dict]:
    flt = dg.AssetRecordsFilter(asset_key=dg.AssetKey("model_checkpoint"),
                                asset_partitions=["remote"])
    out = []
    for rec in instance.fetch_observations(flt, limit=1000).records:
        md = {k: v.value for k, v in rec.asset_observation.metadata.items()}
        if rec.run_id == run_id and md.get("event") == CHECKPOINT:
            out.append(md)
    return out


class _S3Killer(threading.Thread):
    """SIGKILL the trainer (pid from its heartbeat on S3) once step `at_step` is committed
    and a checkpoint message has been uploaded under the Pipes prefix of `bucket` (the
    trainer uploads its messages in batches: killed before its first upload, it would have
    reported nothing, and the test would prove nothing about reports through S3)."""

    def __init__(self, uri: str, run: str, at_step: int, bucket: str):
        super().__init__(daemon=True)
        self.repo = CheckpointRepo(open_store(uri), "default", run)
        self.at_step, self.bucket, self.killed_at = at_step, bucket, None

    def run(self) -> None:
        def fire() -> bool:
            ptr, beat = self.repo.read_pointer(), self.repo.read_heartbeat()
            if not ptr or ptr.step is None or ptr.step < self.at_step or not beat:
                return False
            if not any(m["type"] == CHECKPOINT_MESSAGE for m in _pipes_messages(self.bucket)):
                return False
            os.kill(int(beat["pid"]), signal.SIGKILL)
            self.killed_at = ptr.step
            return True

        try:
            wait_for(fire, 240, 0.05, f"step {self.at_step} to be committed")
        except (WaitTimeout, ProcessLookupError):
            pass


def test_a_sigkilled_trainer_reached_only_through_s3_resumes_bitwise_identically(
        remote, instance, mlflow_uri, tmp_path, monkeypatch):
    # The resume as a second run, handed nothing but S3, is the point: the killed trainer's
    # step must fail rather than relaunch it in its own run (the default).
    monkeypatch.setenv(Setting.IN_RUN_RELAUNCH, "0")
    cfg = training_config(dataset=remote["dataset"], max_steps=40)
    (tmp_path / "base.json").write_text(json.dumps({**cfg, "run": "remote"}))
    base = run_trainer(tmp_path / "base.json", str(tmp_path / "base-store"), env={
        k: v for k, v in os.environ.items() if k.startswith("AWS_")})
    assert base.returncode == 0, base.log
    uninterrupted = training_state(final_state(tmp_path / "base-store", run="remote"))

    slow = {**cfg, "task_args": {**cfg["task_args"], "step_delay": 0.1}}
    resources = make_resources(store=remote["store"], trainer=remote["trainer"],
                               tracking_uri=mlflow_uri)
    killer = _S3Killer(remote["uri"], "remote", at_step=12, bucket=remote["bucket"])
    killer.start()
    first = materialize_run(instance, "remote", resources, training=slow)
    killer.join(10)
    assert killer.killed_at is not None and not first.success
    # (A failed step's events are in the instance, not all in its result.)
    reported = [md for md in _observed_checkpoints(instance, first.run_id)
                if not md.get("recorded_late")]
    assert reported and reported[0]["step"] <= killer.killed_at, "reported through S3"
    second = materialize_run(instance, "remote", resources)
    assert second.success
    resumed = [m for m in checkpoints(second) if not m.get("recorded_late")]
    assert resumed[0]["resumed_from_step"] is not None and resumed[0]["attempt"] == 2
    for launch in remote["started"]:
        _assert_launched_without_local_files(launch, remote["home"])
    assert_bitwise_equal(uninterrupted, training_state(final_state_s3(remote["uri"],
                                                                      run="remote")))


def test_a_config_missing_from_the_store_is_bad_input_that_names_it(s3_env, tmp_path):
    missing = f"s3://{s3_env['bucket']}/nowhere/config.json"
    res = subprocess.run([sys.executable, "-m", "trainer", "--config", missing, "--store",
                          s3_env["uri"]], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
                         timeout=300)
    assert res.returncode == 2, res.stderr
    assert f"config file {missing} does not exist" in res.stderr
