"""Resources: the checkpoint store, the trainer launcher settings, MLflow tracking.

All three resolve their defaults at run time (not when the definitions are loaded), so an
environment variable set for a run (CKPT_STORE_URI, MLFLOW_TRACKING_URI, DAGSTER_HOME)
takes effect without reloading the code location.
"""


import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import dagster as dg
from pydantic import Field, PrivateAttr

from ckpt_assets.attempt.k8s_pod import POD_WORKDIR, K8sTrainerConfig, Launcher
from ckpt_assets.attempt.warm_start import WarmTrainer
from ckpt_assets.base.names import REPO_ROOT
from ckpt_assets.lifecycle.settings import ResumeSettings
from trainer.checkpoints.repo import CheckpointRepo
from trainer.process.contract import Env, PipesTransport
from trainer.storage import ObjectStore, open_store
from trainer.storage.file_lock import lock_exclusive

S3_MAX_ATTEMPTS = 5  # the trainer's too (trainer.storage.s3.default_client)


def default_store_uri() -> str:
    """$CKPT_STORE_URI, else `checkpoints/` under the repository root (the embedded default)."""
    return os.environ.get(Env.STORE_URI) or str(REPO_ROOT / "checkpoints")


def git_commit() -> str | None:
    """ckpt-assets' own code version (git commit, +dirty), recorded in lineage."""
    from trainer.process.code_version import ckpt_assets_version

    return ckpt_assets_version()


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
            from trainer.storage.s3 import S3Store

            parsed = urlparse(uri)
            return S3Store(parsed.netloc, parsed.path.strip("/"), client=self.s3_client())
        return open_store(uri)

    def s3_resource(self):
        """dagster-aws's S3Resource with this resource's endpoint, region and credentials
        (each unset one comes from the standard AWS environment, as for the trainer)."""
        from dagster_aws.s3 import S3Resource

        return S3Resource(endpoint_url=self.endpoint_url, region_name=self._region(),
                          aws_access_key_id=self.aws_access_key_id,
                          aws_secret_access_key=self.aws_secret_access_key,
                          max_attempts=S3_MAX_ATTEMPTS)

    def s3_client(self):
        """An S3 client for the store and for datasets on S3, built by S3Resource: retries in
        botocore's standard mode, like the trainer's own client."""
        return self.s3_resource().get_client()

    def _region(self) -> str:
        # As the trainer's client: the configured region, else the environment's or the
        # profile's, else us-east-1 (which any S3-compatible server accepts for signing).
        if self.region_name:
            return self.region_name
        import boto3

        return boto3.session.Session().region_name or "us-east-1"

    def repo(self, experiment: str, run: str) -> CheckpointRepo:
        return CheckpointRepo(self.open(), experiment, run)


class TrainerResource(dg.ConfigurableResource):
    """How `model_checkpoint` starts `python -m trainer`."""

    python_executable: str | None = Field(default=None, description="default: this interpreter")
    grace_period_seconds: float = Field(
        default=20.0,
        description="after SIGTERM, how long the trainer may take to commit and exit before "
                    "SIGKILL (keep below run_monitoring.cancel_timeout_seconds)")
    extra_env: dict[str, str] = Field(default_factory=dict, description="added to the trainer's env")
    log_level: str = Field(default="INFO", description="trainer --log-level")
    working_directory: str | None = Field(
        default=None, description="where the trainer runs, and what a command's relative cwd "
                                  "is relative to (default: the repository root)")
    pythonpath: list[str] = Field(
        default_factory=list,
        description="directories put first on the trainer's PYTHONPATH, so that a task module "
                    "or a command's imports outside this repository are found")
    pipes: str = Field(
        default="local",
        description="how the Pipes context and messages travel: 'local' (temp files on this "
                    "machine) or 's3' (objects under pipes_s3_uri: a trainer that shares no "
                    "filesystem with Dagster)")
    pipes_s3_uri: str | None = Field(
        default=None, description="s3://bucket/prefix for pipes: s3 (default: the checkpoint "
                                  "store's bucket, prefix 'pipes/')")
    pipes_s3_interval_seconds: float = Field(
        default=1.0, description="pipes: s3: how often messages are uploaded and read back")
    launcher: str = Field(
        default=Launcher.LOCAL.value,
        description="where an attempt's process runs: 'local' (a process of the run worker) "
                    "or 'k8s' (a Kubernetes pod, configured by `k8s`; needs pipes: s3)")
    k8s: K8sTrainerConfig | None = Field(
        default=None, description="launcher: k8s: the pod (image, namespace, resources per "
                                  "rank, the AWS Secret, ...); python_executable, "
                                  "working_directory and pythonpath then name paths in the image")

    # The run's standby trainer: one for all of a run's steps (the in-process executor runs
    # them in one process, with one instance of each resource), so that the standby its
    # first step starts is the one the training step hands the first attempt to.
    _warm: WarmTrainer | None = PrivateAttr(default=None)
    # The run worker's environment as the run's first attempt (or its standby) inherited it.
    _environ: dict[str, str] | None = PrivateAttr(default=None)

    @property
    def worker_environ(self) -> dict[str, str]:
        """What every attempt of this run inherits of the run worker's environment: the
        environment as the run first started one. Libraries the worker loads meanwhile add
        variables for themselves (importing torch._dynamo sets TORCHINDUCTOR_CACHE_DIR,
        MLflow a telemetry id); one that torch reads at start reaching only later attempts
        made the standby started beside the first attempt unfit for the second, which then
        started cold."""
        if self._environ is None:
            self._environ = dict(os.environ)
        return self._environ

    def warm_trainer(self, log) -> WarmTrainer:
        """This run's warm trainer (`ckpt_assets.attempt.warm_start`), logging to `log`."""
        if self._warm is None:
            self._warm = WarmTrainer(ResumeSettings.from_env(), log)
        self._warm.log = log
        return self._warm

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._warm is not None:  # a standby no step handed an attempt (a step failed)
            self._warm.close()
            self._warm = None
        self._environ = None  # the next run inherits the worker's environment as it is then

    @property
    def in_pod(self) -> bool:
        return self.launcher == Launcher.K8S

    @property
    def python(self) -> str:
        # In a pod, the image's interpreter, not the run worker's path to its own.
        return self.python_executable or ("python" if self.in_pod else sys.executable)

    @property
    def cwd(self) -> str:
        return self.working_directory or (POD_WORKDIR if self.in_pod else str(REPO_ROOT))

    @property
    def shares_filesystem(self) -> bool:
        """Whether the trainer can read the run worker's files (not with Pipes over S3:
        then it reads its config from the store too)."""
        return self.pipes != PipesTransport.S3


SQLITE = "sqlite:///"


def default_tracking_uri() -> str:
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    home = os.environ.get("DAGSTER_HOME") or str(REPO_ROOT / "dagster_home")
    return f"{SQLITE}{Path(home).absolute() / 'mlflow.db'}"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a `sqlite:///` tracking URI, else None."""
    return Path(uri[len(SQLITE):]).absolute() if uri.startswith(SQLITE) else None


# Run workers migrating a new database take turns; each can take a minute on a busy machine.
MLFLOW_LOCK_WAIT_S = 600.0


@contextmanager
def creating_tables(db: Path) -> Iterator[None]:
    """One process at a time on this machine: MLflow creates a new database's tables (its
    whole migration history) in whichever process uses it first, and two run workers that
    start together on a new file both do, and leave it half migrated for every later run
    ("Online migration expected to match one row ... 0 found", "table _alembic_tmp_runs
    already exists"): the first two runs of a fresh instance trained without MLflow."""
    db.parent.mkdir(parents=True, exist_ok=True)
    with open(db.with_name(db.name + ".lock"), "a") as lock:
        # Bounded, and not waited for at all behind a stopped run worker: the caller goes on
        # without MLflow rather than hang (released when the file is closed).
        lock_exclusive(lock.fileno(), f"the MLflow database {db}", wait_s=MLFLOW_LOCK_WAIT_S)
        yield


# The MLflow UI's base URL when the tracking URI is not one (a sqlite file read by
# `mlflow ui --backend-store-uri ...`): Dagster's metadata then links to each MLflow run.
MLFLOW_UI_URL_ENV = "CKPT_MLFLOW_UI_URL"


class MLflowResource(dg.ConfigurableResource):
    """MLflow tracking: one MLflow run per training run, continued across attempts.

    `tracking_uri`: default $MLFLOW_TRACKING_URI, else `sqlite:///$DAGSTER_HOME/mlflow.db`.
    `ui_url`: the MLflow UI's base URL, for links from Dagster's metadata; default
    $CKPT_MLFLOW_UI_URL, else the tracking URI when it is an http(s) server.
    `experiment_name`: default the training config's experiment. Artifacts of a sqlite
    or file store go next to it (`mlartifacts/`) unless `artifact_location` is set.
    MLflow is a view: a tracking error is logged as a warning and never fails training.
    """

    tracking_uri: str | None = None
    experiment_name: str | None = None
    artifact_location: str | None = None
    register_model: bool = True
    enabled: bool = True
    ui_url: str | None = None

    @property
    def resolved_tracking_uri(self) -> str:
        return self.tracking_uri or default_tracking_uri()

    @property
    def resolved_ui_url(self) -> str:
        """Where the MLflow UI is, or the tracking URI (links only for http(s) ones)."""
        return self.ui_url or os.environ.get(MLFLOW_UI_URL_ENV) or self.resolved_tracking_uri

    def resolved_artifact_location(self) -> str | None:
        if self.artifact_location:
            return self.artifact_location
        uri = self.resolved_tracking_uri
        if (db := sqlite_file(uri)) is not None:
            return str(db.parent / "mlartifacts")
        parsed = urlparse(uri)
        if parsed.scheme in ("", "file"):
            return str(Path(parsed.path or uri).absolute() / "mlartifacts")
        return None

    def client(self):
        from mlflow.tracking import MlflowClient

        uri = self.resolved_tracking_uri
        if (db := sqlite_file(uri)) is None:
            return MlflowClient(tracking_uri=uri, registry_uri=uri)
        with creating_tables(db):  # the client makes the tables, as may each store's first use
            client = MlflowClient(tracking_uri=uri, registry_uri=uri)
            client.search_experiments(max_results=1)
            client.search_registered_models(max_results=1)
        return client
