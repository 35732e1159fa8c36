"""Resources: the checkpoint store, the trainer launcher settings, MLflow tracking.

All three resolve their defaults at run time (not when the definitions are loaded), so an
environment variable set for a run (CKPT_STORE_URI, MLFLOW_TRACKING_URI, DAGSTER_HOME)
takes effect without reloading the code location.
"""


import functools
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import dagster as dg
from pydantic import Field

from trainer.repo import CheckpointRepo
from trainer.storage import ObjectStore, open_store

REPO_ROOT = Path(__file__).resolve().parents[1]


def default_store_uri() -> str:
    """$CKPT_STORE_URI, else `checkpoints/` under the repository root (the embedded default)."""
    return os.environ.get("CKPT_STORE_URI") or str(REPO_ROOT / "checkpoints")


@functools.cache
def git_commit() -> str | None:
    """The repository's git commit (the code version recorded in lineage), if known."""
    if os.environ.get("CKPT_CODE_VERSION"):
        return os.environ["CKPT_CODE_VERSION"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=REPO_ROOT)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


class CheckpointStore(dg.ConfigurableResource):
    """Where checkpoints, registered configs and asset outputs live.

    `uri`: `file:///abs/path`, a plain directory, or `s3://bucket/prefix`; default
    $CKPT_STORE_URI, else `checkpoints/` under the repository root. For S3 the endpoint,
    region and credentials come from the standard AWS environment unless set here; pass
    secrets as `dg.EnvVar("AWS_SECRET_ACCESS_KEY")`, never as literals. Whatever is set here
    is also handed to the trainer subprocess as AWS_* variables, so both sides talk to the
    same endpoint.
    """

    uri: str | None = Field(default=None, description="Store URI; default $CKPT_STORE_URI or ./checkpoints")
    endpoint_url: str | None = Field(default=None, description="S3-compatible endpoint (AWS_ENDPOINT_URL)")
    region_name: str | None = Field(default=None, description="AWS region")
    aws_access_key_id: str | None = Field(default=None, description="use dg.EnvVar")
    aws_secret_access_key: str | None = Field(default=None, description="use dg.EnvVar")

    @property
    def resolved_uri(self) -> str:
        return self.uri or default_store_uri()

    @property
    def is_s3(self) -> bool:
        return urlparse(self.resolved_uri).scheme == "s3"

    def aws_env(self) -> dict[str, str]:
        """AWS_* variables for a subprocess (only those configured here)."""
        pairs = {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_DEFAULT_REGION": self.region_name,
                 "AWS_ACCESS_KEY_ID": self.aws_access_key_id,
                 "AWS_SECRET_ACCESS_KEY": self.aws_secret_access_key}
        return {k: v for k, v in pairs.items() if v}

    def open(self) -> ObjectStore:
        uri = self.resolved_uri
        if self.is_s3 and self.aws_env():
            return _s3_store(uri, self.endpoint_url, self.region_name, self.aws_access_key_id,
                             self.aws_secret_access_key)
        return open_store(uri)

    def repo(self, experiment: str, run: str) -> CheckpointRepo:
        return CheckpointRepo(self.open(), experiment, run)


def _s3_store(uri: str, endpoint_url, region, key_id, secret) -> ObjectStore:
    import boto3
    from botocore.config import Config

    from trainer.storage.s3 import S3Store

    parsed = urlparse(uri)
    session = boto3.session.Session(aws_access_key_id=key_id, aws_secret_access_key=secret,
                                    region_name=region)
    client = session.client(
        "s3", endpoint_url=endpoint_url, region_name=session.region_name or "us-east-1",
        config=Config(retries={"mode": "standard", "max_attempts": 5}, connect_timeout=10,
                      read_timeout=120),
    )
    return S3Store(parsed.netloc, parsed.path.strip("/"), client=client)


class TrainerResource(dg.ConfigurableResource):
    """How `model_checkpoint` starts `python -m trainer`."""

    python_executable: str | None = Field(default=None, description="default: this interpreter")
    grace_period_seconds: float = Field(
        default=20.0,
        description="after SIGTERM, how long the trainer may take to commit and exit before "
                    "SIGKILL (keep below run_monitoring.cancel_timeout_seconds)")
    extra_env: dict[str, str] = Field(default_factory=dict, description="added to the trainer's env")
    log_level: str = Field(default="INFO", description="trainer --log-level")
    working_directory: str | None = Field(default=None, description="default: repository root")

    @property
    def python(self) -> str:
        return self.python_executable or sys.executable

    @property
    def cwd(self) -> str:
        return self.working_directory or str(REPO_ROOT)


def default_tracking_uri() -> str:
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    home = os.environ.get("DAGSTER_HOME") or str(REPO_ROOT / "dagster_home")
    return f"sqlite:///{Path(home).absolute() / 'mlflow.db'}"


class MLflowResource(dg.ConfigurableResource):
    """MLflow tracking: one MLflow run per training run, continued across attempts.

    `tracking_uri`: default $MLFLOW_TRACKING_URI, else `sqlite:///$DAGSTER_HOME/mlflow.db`.
    `experiment_name`: default the training config's experiment. Artifacts of a sqlite
    or file store go next to it (`mlartifacts/`) unless `artifact_location` is set.
    MLflow is a view: a tracking error is logged as a warning and never fails training.
    """

    tracking_uri: str | None = None
    experiment_name: str | None = None
    artifact_location: str | None = None
    register_model: bool = True
    enabled: bool = True

    @property
    def resolved_tracking_uri(self) -> str:
        return self.tracking_uri or default_tracking_uri()

    def resolved_artifact_location(self) -> str | None:
        if self.artifact_location:
            return self.artifact_location
        uri = self.resolved_tracking_uri
        if uri.startswith("sqlite:///"):
            return str(Path(uri[len("sqlite:///"):]).absolute().parent / "mlartifacts")
        parsed = urlparse(uri)
        if parsed.scheme in ("", "file"):
            return str(Path(parsed.path or uri).absolute() / "mlartifacts")
        return None

    def client(self):
        from mlflow.tracking import MlflowClient

        uri = self.resolved_tracking_uri
        if uri.startswith("sqlite:///"):
            Path(uri[len("sqlite:///"):]).absolute().parent.mkdir(parents=True, exist_ok=True)
        return MlflowClient(tracking_uri=uri, registry_uri=uri)
