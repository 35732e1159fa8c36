"""No credential is ever stored: with AWS keys in the environment and in the CheckpointStore
config, a full training run on S3 leaves no trace of them in the Dagster instance (event
log, run config, tags, asset metadata, compute logs), the store (manifests, configs, asset
values) or MLflow (database and artifacts). Every stored record is searched byte by byte."""

from __future__ import annotations

from pathlib import Path

import boto3
import dagster as dg
import pytest

from ckpt_assets.definitions import make_resources
from ckpt_assets.defs.resources import CheckpointStore
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import made_mlflow_db, materialize_run, training_config

pytestmark = pytest.mark.slow

KEY_ID = "AKIALEAKCHECK0000042"
SECRET = "leak-check-secret/0123456789+abcdefghijklmnopq"


def _files_holding(root: Path, needles: list[bytes]) -> list[str]:
    hits = []
    for p in root.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            hits += [f"{p}: {n.decode()}" for n in needles if n in data]
    return hits


def test_aws_keys_appear_in_no_stored_record(s3_env, dagster_home, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)  # moto accepts any key pair
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    mlflow_dir = tmp_path / "mlflow"
    mlflow_dir.mkdir()
    tracking = made_mlflow_db(mlflow_dir / "mlflow.db")
    store = CheckpointStore(uri=s3_env["uri"], endpoint_url=dg.EnvVar("AWS_ENDPOINT_URL"),
                            region_name="us-east-1",
                            aws_access_key_id=dg.EnvVar("AWS_ACCESS_KEY_ID"),
                            aws_secret_access_key=dg.EnvVar("AWS_SECRET_ACCESS_KEY"))
    instance = dg.DagsterInstance.get()  # on disk under dagster_home: every record a file
    res = materialize_run(instance, "secret-run",
                          make_resources(store=store, tracking_uri=tracking),
                          training=training_config(), tags={"team": "ml"})
    assert res.success
    needles = [KEY_ID.encode(), SECRET.encode()]

    run = instance.get_run_by_id(res.run_id)
    shown = repr(run.run_config) + repr(run.tags)
    assert not [n for n in needles if n in shown.encode()]
    events = "".join(repr(e) for e in instance.all_logs(res.run_id)).encode()
    assert not [n for n in needles if n in events]
    assert _files_holding(dagster_home, needles) == []
    assert _files_holding(mlflow_dir, needles) == []

    s3 = boto3.client("s3")
    objects = s3.list_objects_v2(Bucket=s3_env["bucket"])["Contents"]
    assert len(objects) > 10
    for obj in objects:
        body = s3.get_object(Bucket=s3_env["bucket"], Key=obj["Key"])["Body"].read()
        assert not [n for n in needles if n in body], obj["Key"]
