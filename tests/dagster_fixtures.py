"""Fixtures and helpers for the Dagster-layer tests (ckpt_assets).

Every test gets its own store, DAGSTER_HOME and MLflow database under tmp_path; nothing is
written into the repository's dagster_home/ or checkpoints/.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from ckpt_assets.base.process_group import group_members
from ckpt_assets.defs.resources import MLflowResource
from tests.polling import WaitTimeout, wait_for
from trainer.storage.file_lock import exclusive_lock

# `from tests.dagster_fixtures import *` brings in the fixtures only; import helpers by name.
__all__ = ["blank_dagster_home", "dagster_home", "instance", "mlflow_uri", "shared_mlflow_db",
           "store_uri"]

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
DAGSTER = str(Path(sys.executable).parent / "dagster")
MLFLOW_DB = "mlflow.db"  # MLflowResource's default database, in DAGSTER_HOME

# Small and fast: 256 samples / batch 32 = 8 steps per epoch (a checkpoint at each epoch end
# and every 10 steps), evals every 20 steps.
BASE_CONFIG: dict[str, Any] = {
    "max_steps": 40,
    "eval_every": 20,
    "batch_size": 32,
    "checkpoint": {"every_steps": 10, "keep_last": 3, "heartbeat_seconds": 0.2},
    "task_args": {"n_train": 256, "n_eval": 128, "hidden": 32},
}


def training_config(**overrides: Any) -> dict[str, Any]:
    cfg = json.loads(json.dumps(BASE_CONFIG))
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    return cfg


# What the suite makes once per machine and versions, and every worker and later run reuses.
TEST_CACHE = ROOT / ".test-cache"


def made_once(name: str, make: Callable[[Path], None]) -> Path:
    """TEST_CACHE/`name`, made by `make(path)` in the first process that needs it while the
    others wait for it: a file or folder never changed once made, so `name` says everything it
    depends on (versions, the hash of its input)."""
    path = TEST_CACHE / name
    if path.exists():
        return path
    TEST_CACHE.mkdir(exist_ok=True)
    dir_fd = os.open(TEST_CACHE, os.O_RDONLY)
    try:
        with exclusive_lock(dir_fd, f"{name}.lock", f"the test cache's {name}", wait_s=600):
            if not path.exists():
                part = TEST_CACHE / f"{name}.{os.getpid()}.part"  # a killed maker's stays apart
                shutil.rmtree(part, ignore_errors=True)
                make(part)
                os.replace(part, path)
    finally:
        os.close(dir_fd)
    return path


def _make_dagster_home(home: Path) -> None:
    home.mkdir()
    shutil.copy(ROOT / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.get_runs(limit=1)
        instance.all_instigator_state()


@pytest.fixture(scope="session")
def blank_dagster_home() -> Path:
    """A DAGSTER_HOME with a copy of the project's dagster_home/dagster.yaml and its SQLite
    storage created: creating it runs schema migrations (seconds), copying it takes
    milliseconds. Never used directly: `dagster_home` gives each test its own copy."""
    yaml = hashlib.sha256((ROOT / "dagster_home" / "dagster.yaml").read_bytes()).hexdigest()
    return made_once(f"dagster_home-{version('dagster')}-{yaml[:12]}", _make_dagster_home)


def _make_mlflow_db(db: Path) -> None:
    from ckpt_assets.defs.resources import MLflowResource

    MLflowResource(tracking_uri=f"sqlite:///{db}").client()


def migrated_mlflow_db() -> Path:
    """An empty MLflow sqlite database with all of MLflow's migrations applied. Making one
    costs seconds of CPU (9 s on a busy 2-core machine); a copy is exactly what MLflow would
    make. The suite's homes and daemons start with a copy; the tests of making one
    (test_mlflow_tracker) make theirs."""
    return made_once(f"mlflow-{version('mlflow')}-{version('sqlalchemy')}.db", _make_mlflow_db)


def made_mlflow_db(path: Path) -> str:
    """The tracking URI of a new, empty MLflow database at `path` (a copy of
    `migrated_mlflow_db`)."""
    shutil.copyfile(migrated_mlflow_db(), path)
    return f"sqlite:///{path}"


def with_migrated_mlflow_db(home: Path) -> None:
    """Give DAGSTER_HOME `home` the default MLflow database (`$DAGSTER_HOME/mlflow.db`), made."""
    made_mlflow_db(home / MLFLOW_DB)


@pytest.fixture
def dagster_home(blank_dagster_home, tmp_path, monkeypatch, request) -> Path:
    """A fresh DAGSTER_HOME holding a copy of the project's dagster_home/dagster.yaml; for a
    slow test (whose runs open MLflow's default database), its MLflow database made too."""
    home = tmp_path / "dagster_home"
    shutil.copytree(blank_dagster_home, home)
    if request.node.get_closest_marker("slow") is not None:
        with_migrated_mlflow_db(home)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    return home


@pytest.fixture
def store_uri(tmp_path, monkeypatch) -> str:
    uri = str(tmp_path / "store")
    monkeypatch.setenv("CKPT_STORE_URI", uri)
    return uri


@pytest.fixture(scope="session")
def shared_mlflow_db(tmp_path_factory) -> str:
    """One MLflow database for the session, a copy of `migrated_mlflow_db`. Tests that assert
    on MLflow's contents make their own (see test_mlflow_lineage)."""
    return made_mlflow_db(tmp_path_factory.mktemp("mlflow") / MLFLOW_DB)


@pytest.fixture
def mlflow_uri(shared_mlflow_db, monkeypatch) -> str:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shared_mlflow_db)
    return shared_mlflow_db


@pytest.fixture
def instance() -> dg.DagsterInstance:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


# Step output is not what the fast tests read, and capturing it would start a `tail` process
# per run: no compute logs.
# The sensors' MLflow resource, off: a test that builds a sensor's context by hand and
# reads no MLflow (the decider records a lost attempt's end there).
NO_MLFLOW = {"mlflow_tracking": MLflowResource(enabled=False)}
NO_COMPUTE_LOGS = {"compute_logs": {"module": "dagster._core.storage.noop_compute_log_manager",
                                    "class": "NoOpComputeLogManager"}}


@contextlib.contextmanager
def instance_in(home: Path, overrides: dict | None = None) -> Iterator[dg.DagsterInstance]:
    """The on-disk instance of DAGSTER_HOME `home` (a test's copy of `blank_dagster_home`, so
    no migration runs), its dagster.yaml overridden by `overrides`."""
    from dagster._core.instance.ref import InstanceRef

    ref = InstanceRef.from_dir(str(home), overrides=overrides or {})
    with dg.DagsterInstance.from_ref(ref) as inst:
        yield inst


def materialize_run(instance: dg.DagsterInstance, key: str, resources: dict,
                    training: dict | None = None, experiment: str | None = None,
                    selection: list | None = None, tags: dict | None = None,
                    with_checks: bool = True,
                    config_op: str = "training_dataset") -> dg.ExecuteInJobResult:
    """materialize() the training assets (and their checks) for partition `key`."""
    from ckpt_assets.defs.assets import TRAINING_ASSETS
    from ckpt_assets.defs.checks import TRAINING_CHECKS

    if not instance.has_dynamic_partition("training_runs", key):
        instance.add_dynamic_partitions("training_runs", [key])
    op_config: dict[str, Any] = {}
    if training is not None:
        op_config["training"] = training
    if experiment is not None:
        op_config["experiment"] = experiment
    run_config = {"ops": {config_op: {"config": op_config}}} if op_config else None
    assets = list(TRAINING_ASSETS) + (list(TRAINING_CHECKS) if with_checks else [])
    return dg.materialize(assets, instance=instance, partition_key=key, resources=resources,
                          run_config=run_config, selection=selection, tags=tags,
                          raise_on_error=False)


def materializations(result: dg.ExecuteInJobResult, asset: str) -> list[dict[str, Any]]:
    """Metadata (plain values) of each ASSET_MATERIALIZATION of `asset` in a run, in order."""
    out = []
    for ev in result.all_events:
        if ev.event_type_value == "ASSET_MATERIALIZATION" and ev.asset_key == dg.AssetKey(asset):
            md = ev.step_materialization_data.materialization.metadata
            out.append({k: v.value for k, v in md.items()})
    return out


def observations(result: dg.ExecuteInJobResult, asset: str,
                 event: str | None = None) -> list[dict[str, Any]]:
    """Metadata of each ASSET_OBSERVATION of `asset` in a run (of one `event` kind), in order."""
    out = []
    for ev in result.all_events:
        if ev.event_type_value == "ASSET_OBSERVATION" and ev.asset_key == dg.AssetKey(asset):
            md = {k: v.value for k, v in ev.event_specific_data.asset_observation.metadata.items()}
            if event is None or md.get("event") == event:
                out.append(md)
    return out


def checkpoints(result: dg.ExecuteInJobResult) -> list[dict[str, Any]]:
    """The checkpoints a run recorded (model_checkpoint's `checkpoint` observations)."""
    return observations(result, "model_checkpoint", "checkpoint")


def step_failure_metadata(result: dg.ExecuteInJobResult, step: str = "model_checkpoint"):
    """(description, metadata) of the step's dagster.Failure, as the resume sensor reads it."""
    for ev in result.all_events:
        if ev.event_type_value == "STEP_FAILURE" and ev.step_key == step:
            ufd = ev.step_failure_data.user_failure_data
            if ufd is None:
                return None, None
            return ufd.description, {k: v.value for k, v in ufd.metadata.items()}
    raise AssertionError(f"no STEP_FAILURE for {step}")


def check_results(result: dg.ExecuteInJobResult) -> dict[str, bool]:
    return {ev.event_specific_data.check_name: ev.event_specific_data.passed
            for ev in result.all_events if ev.event_type_value == "ASSET_CHECK_EVALUATION"}


def read_heartbeat_pid(store_dir: Path, experiment: str, run: str) -> int | None:
    try:
        return int(json.loads((store_dir / experiment / run / "heartbeat.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def pointer_step(store_dir: Path, experiment: str, run: str) -> int | None:
    try:
        return json.loads((store_dir / experiment / run / "checkpoints" / "latest.json")
                          .read_text()).get("step")
    except (OSError, ValueError):
        return None


class TrainerKiller(threading.Thread):
    """Once the run's latest.json reaches `at_step`, send `sig` to the trainer (pid from its
    heartbeat file): a real signal to the real process, from outside, like a preemption."""

    def __init__(self, store_dir: Path, experiment: str, run: str, at_step: int,
                 sig: int = signal.SIGKILL, timeout: float = 300):
        super().__init__(daemon=True)
        self.args_ = (store_dir, experiment, run)
        self.at_step, self.sig, self.timeout = at_step, sig, timeout
        self.killed_pid: int | None = None
        self.step_seen: int | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        def fired() -> bool:
            if self._halt.is_set():
                return True
            step = pointer_step(*self.args_)
            pid = read_heartbeat_pid(*self.args_)
            if step is None or step < self.at_step or not pid:
                return False
            try:
                os.kill(pid, self.sig)
                self.killed_pid, self.step_seen = pid, step
            except ProcessLookupError:
                pass
            return True

        # Not firing is the test's to notice (killed_pid stays None); this thread just ends.
        with contextlib.suppress(WaitTimeout):
            wait_for(fired, self.timeout, 0.01, f"step {self.at_step} to be committed")

    def cancel(self) -> None:
        self._halt.set()


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m ckpt_assets ...` from the repository root, as a user would run it."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([PYTHON, "-m", "ckpt_assets", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)


def dagster_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([DAGSTER, *args], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=timeout)


def stop_process_group(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM a process started with start_new_session=True and its children, and wait for
    all of them (`dagster dev`'s webserver, daemon and code servers outlive its main
    process); SIGKILL whatever is left after `grace` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass

    def all_gone() -> bool:
        proc.poll()  # reap the main process once it exits
        return not group_members(proc.pid)

    with contextlib.suppress(WaitTimeout):  # then SIGKILL
        wait_for(all_gone, grace, 0.2, f"process group {proc.pid} to exit")
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()

