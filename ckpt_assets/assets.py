"""The three assets of a training run: training_dataset -> model_checkpoint -> final_model.

All are partitioned by `training_runs` (partition key = run name). The training config of
a run is registered once (see `ckpt_assets.partitions`); every asset of every attempt reads
the registered config. A run's first launch may carry it in the run config:

    ops:
      training_dataset:
        config:
          experiment: demo                 # optional
          training: {max_steps: 200, task_args: {n_train: 1024}}

`model_checkpoint` runs `python -m trainer` as its own process through Dagster Pipes and
turns the trainer's reports into Dagster events:

* each committed checkpoint -> an ASSET_MATERIALIZATION of model_checkpoint for the
  partition, with the lineage metadata (see CHECKPOINT_METADATA_KEYS);
* the end of the attempt -> an ASSET_OBSERVATION `attempt_ended` with the same keys as
  the failure metadata below (also on success and on cancellation);
* a non-zero exit -> `dagster.Failure` whose metadata is the contract the resume sensor
  reads from STEP_FAILURE events: FAILURE_METADATA_KEYS.
"""


import ctypes
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import Field

from ckpt_assets.io_managers import CHECKPOINT_KEY
from ckpt_assets.lineage import (
    TAG_ATTEMPT,
    TAG_PARENT_RUN_ID,
    TAG_ROOT_RUN_ID,
    MlflowTracker,
)
from ckpt_assets.partitions import (
    PARTITION_TAG,
    Registration,
    read_registration,
    register_training_run,
    training_runs,
    validate_partition_key,
)
from ckpt_assets.resources import CheckpointStore, MLflowResource, TrainerResource, git_commit
from trainer.errors import FAILURE_CLASSES, CheckpointError, ConfigError, StorageError
from trainer.repo import CheckpointRepo, Pointer
from trainer.storage import ObjectStore

# Output(data_version=...) and Pipes' writer count are marked beta/preview in 1.13.
warnings.filterwarnings("ignore", category=dg.BetaWarning, message=".*data_version.*")
warnings.filterwarnings("ignore", category=dg.PreviewWarning, message=".*expected_writer_count.*")

IO_MANAGER_KEY = "checkpoint_io_manager"
GROUP = "training"
MODEL_CHECKPOINT_KEY = dg.AssetKey("model_checkpoint")

# The metadata contract of a failed model_checkpoint step (dagster.Failure metadata).
FAILURE_METADATA_KEYS = ("exit_code", "failure_class", "last_committed_step", "checkpoint_uri",
                         "attempt", "training_run")
# Lineage metadata of every checkpoint materialization.
CHECKPOINT_METADATA_KEYS = ("step", "uri", "name", "sha256", "size", "loss", "parent",
                            "parent_checkpoint", "save_seconds", "experiment", "training_run",
                            "dagster_run_id", "root_run_id", "attempt", "resumed_from_step",
                            "code_version", "data_version")


class TrainingRunConfig(dg.Config):
    """Run config of the training assets. Needed only for a run's first launch."""

    training: dict[str, Any] | None = Field(
        default=None,
        description="Training config (the trainer's JSON/YAML config as a mapping). Registered "
                    "on the first launch of the run; later launches may omit it and must not "
                    "change it. 'run' is forced to the partition key.")
    experiment: str | None = Field(
        default=None, description="Experiment of the run (default: the config's, else 'default').")


# -- helpers ------------------------------------------------------------------------------------

def to_metadata(values: dict[str, Any]) -> dict[str, Any]:
    """Plain values -> Dagster metadata (None -> null, dict/list -> JSON, inf/nan -> text)."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if v is None:
            out[k] = dg.MetadataValue.null()
        elif isinstance(v, bool):
            out[k] = dg.MetadataValue.bool(v)
        elif isinstance(v, float) and not math.isfinite(v):
            out[k] = dg.MetadataValue.text(str(v))
        elif isinstance(v, dict | list):
            out[k] = dg.MetadataValue.json(v)
        else:
            out[k] = v
    return out


def fail(description: str, *, exit_code: int, failure_class: str, run: str, attempt: int = 0,
         last_committed_step: int | None = None, checkpoint_uri: str | None = None,
         **extra: Any) -> dg.Failure:
    md = {"exit_code": int(exit_code), "failure_class": failure_class,
          "last_committed_step": last_committed_step, "checkpoint_uri": checkpoint_uri,
          "attempt": int(attempt), "training_run": run, **extra}
    return dg.Failure(description=description, metadata=to_metadata(md))


def partition_key(context) -> str:
    try:
        return validate_partition_key(context.partition_key)
    except ConfigError as e:
        raise fail(str(e), exit_code=2, failure_class="bad_input",
                   run=str(context.partition_key)) from e


def resolve_registration(context, checkpoint_store: CheckpointStore,
                         config: TrainingRunConfig) -> Registration:
    """Register the run's config if this launch carries one; else read the registered one."""
    run = partition_key(context)
    training, experiment = config.training, config.experiment
    if training is None:
        # The training config may have been given to any of the run's training ops.
        for op in (context.run.run_config or {}).get("ops", {}).values():
            other = (op or {}).get("config") or {}
            if other.get("training") is not None:
                training, experiment = other["training"], experiment or other.get("experiment")
                break
    try:
        store = checkpoint_store.open()
        if training is not None:
            reg = register_training_run(store, run, training, experiment)
            if reg.created:
                context.log.info(f"registered training run {run!r}: {reg.config_uri}")
        else:
            reg = read_registration(store, run)
            if reg is None:
                raise ConfigError(
                    f"training run {run!r} has no registered config in {store.uri}. Launch "
                    "its first run with ops.training_dataset.config.training set to the "
                    "training config, or run: python -m ckpt_assets register "
                    f"{run} --config FILE")
            if experiment and experiment != reg.experiment:
                raise ConfigError(f"training run {run!r} is registered in experiment "
                                  f"{reg.experiment!r}, not {experiment!r}")
    except ConfigError as e:
        raise fail(str(e), exit_code=2, failure_class="bad_input", run=run) from e
    except StorageError as e:
        raise fail(str(e), exit_code=5, failure_class="storage_unavailable", run=run) from e
    return reg


def _task_module(spec: str):
    import importlib

    return importlib.import_module(spec.partition(":")[0])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _signal_name(rc: int) -> str | None:
    num = -rc if rc < 0 else rc - 128 if 128 < rc < 160 else None
    if num is None:
        return None
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def failure_class_for(rc: int, failed_msg: dict[str, Any] | None) -> str:
    if failed_msg and failed_msg.get("failure_class"):
        return str(failed_msg["failure_class"])
    if rc == 143:
        return "preempted"
    if rc < 0 or (128 < rc < 160):
        return "killed_by_signal"
    return FAILURE_CLASSES.get(rc, "error")


def count_earlier_attempts(instance: dg.DagsterInstance, run_id: str, key: str) -> int:
    """Earlier Dagster runs of this partition that included model_checkpoint."""
    runs = instance.get_runs(filters=dg.RunsFilter(tags={PARTITION_TAG: key}))  # newest first
    ids = [r.run_id for r in runs]
    earlier = runs[ids.index(run_id) + 1:] if run_id in ids else runs
    return sum(1 for r in earlier
               if r.asset_selection is None or MODEL_CHECKPOINT_KEY in r.asset_selection)


def checkpoint_metadata(msg: dict[str, Any], run: str) -> dict[str, Any]:
    lin = msg.get("lineage") or {}
    return {
        "step": msg.get("step"), "uri": msg.get("uri"), "name": msg.get("name"),
        "sha256": msg.get("sha256"), "size": msg.get("size"), "loss": msg.get("loss"),
        "parent": msg.get("parent"), "parent_checkpoint": msg.get("parent"),
        "save_seconds": msg.get("save_seconds"), "blocking_seconds": msg.get("blocking_seconds"),
        "eval": msg.get("eval") or None,
        "experiment": lin.get("experiment"), "training_run": run,
        "dagster_run_id": lin.get("dagster_run_id"), "root_run_id": lin.get("root_run_id"),
        "attempt": lin.get("attempt"), "resumed_from_step": lin.get("resumed_from_step"),
        "code_version": lin.get("code_version"), "data_version": lin.get("data_version"),
    }


def _pointer(repo: CheckpointRepo) -> Pointer | None:
    try:
        return repo.read_pointer()
    except (CheckpointError, StorageError):
        return None


# -- training_dataset ---------------------------------------------------------------------------

@dg.asset(
    partitions_def=training_runs,
    io_manager_key=IO_MANAGER_KEY,
    group_name=GROUP,
    code_version="training_dataset.v1",
    kinds={"pytorch"},
    metadata={"ckpt/store_dir": "assets/training_dataset", "ckpt/filename": "dataset"},
    description="The run's dataset, generated from the registered config's task_args; its "
                "content hash is the data version recorded in every checkpoint's lineage.",
)
def training_dataset(context: dg.AssetExecutionContext, config: TrainingRunConfig,
                     checkpoint_store: CheckpointStore):
    import inspect

    reg = resolve_registration(context, checkpoint_store, config)
    cfg = reg.config
    module = _task_module(cfg["task"])
    make, digest = getattr(module, "make_dataset", None), getattr(module, "dataset_hash", None)
    if not (callable(make) and callable(digest)):
        raise fail(f"task {cfg['task']!r} has no make_dataset()/dataset_hash(); "
                   "training_dataset can prepare data only for tasks that define them",
                   exit_code=2, failure_class="bad_input", run=reg.run)
    params = inspect.signature(make).parameters
    kwargs = {k: v for k, v in cfg["task_args"].items() if k in params}
    data = make(**kwargs)
    version = digest(data)
    import torch  # here, not at module level: loading the code location stays fast

    sizes = {k: list(v.shape) for k, v in data.items() if isinstance(v, torch.Tensor)}
    nbytes = sum(v.numel() * v.element_size() for v in data.values() if isinstance(v, torch.Tensor))
    return dg.Output(
        data,
        data_version=dg.DataVersion(version),
        metadata=to_metadata({
            "data_version": version, "experiment": reg.experiment, "training_run": reg.run,
            "bytes": int(nbytes), "shapes": sizes, "dataset_args": kwargs,
            "n_train": int(data["x_train"].shape[0]) if "x_train" in data else None,
            "n_eval": int(data["x_eval"].shape[0]) if "x_eval" in data else None,
            "code_version": git_commit(), "config_uri": reg.config_uri,
        }),
    )


# -- model_checkpoint ---------------------------------------------------------------------------

class _Attempt:
    """What the orchestrator learned from the trainer's Pipes messages during one attempt."""

    def __init__(self) -> None:
        self.started: dict[str, Any] | None = None
        self.failed: dict[str, Any] | None = None
        self.stopped: dict[str, Any] | None = None
        self.finished: dict[str, Any] | None = None
        self.checkpoints: list[dict[str, Any]] = []


@dg.asset(
    partitions_def=training_runs,
    io_manager_key=IO_MANAGER_KEY,
    group_name=GROUP,
    code_version="model_checkpoint.v1",
    kinds={"pytorch"},
    metadata={"ckpt/load": "checkpoint_state"},
    description="Trains (or resumes) the run with `python -m trainer` via Dagster Pipes. One "
                "materialization per committed checkpoint; its value is the run's final "
                "checkpoint record, and as an input it loads the newest valid checkpoint's "
                "verified state.",
)
def model_checkpoint(context: dg.AssetExecutionContext, config: TrainingRunConfig,
                     training_dataset: dict, checkpoint_store: CheckpointStore,
                     trainer: TrainerResource, mlflow_tracking: MLflowResource):
    reg = resolve_registration(context, checkpoint_store, config)
    run = reg.run
    run_tags = context.run.tags
    store: ObjectStore = checkpoint_store.open()
    repo = CheckpointRepo(store, reg.experiment, run)

    try:
        store_next = repo.next_attempt()
    except StorageError as e:
        raise fail(str(e), exit_code=5, failure_class="storage_unavailable", run=run) from e
    tag = run_tags.get(TAG_ATTEMPT)
    attempt = int(tag) if tag and tag.isdigit() else 1 + count_earlier_attempts(
        context.instance, context.run.run_id, run)
    if store_next > attempt:
        context.log.warning(f"the store already holds attempt {store_next - 1} of {run}; "
                            f"this attempt is numbered {store_next} instead of {attempt}")
        attempt = store_next
    root_run_id = run_tags.get(TAG_ROOT_RUN_ID) or context.run.run_id
    parent_run_id = run_tags.get(TAG_PARENT_RUN_ID)
    code_version = git_commit()

    import torch

    from trainer.tasks.toy import dataset_hash

    workdir = Path(tempfile.mkdtemp(prefix=f"ckpt-{run}-a{attempt}-"))
    try:
        data_path = workdir / "dataset.pt"
        torch.save(training_dataset, data_path)
        data_version = dataset_hash(training_dataset)
        resolved = json.loads(json.dumps(reg.config))
        resolved["task_args"]["data_path"] = str(data_path)
        config_path = workdir / "config.json"
        config_path.write_text(json.dumps(resolved, indent=1))

        tracker = MlflowTracker(mlflow_tracking, reg.experiment, run, context.log)

        def open_tracking() -> None:
            # Called right after the trainer started: MLflow's start-up overlaps the
            # trainer's, and no message is handled before the run is open.
            run_id = tracker.start({
                "dagster_run_id": context.run.run_id, "dagster_root_run_id": root_run_id,
                "dagster_parent_run_id": parent_run_id, "attempt": attempt,
                "attempts": attempt, "code_version": code_version, "data_version": data_version,
                "store": store.uri,
            })
            if run_id:
                context.log.info(f"MLflow run {run_id} ({mlflow_tracking.resolved_tracking_uri})")
                if tracker.backfill(repo):
                    context.log.info("MLflow: logged committed checkpoints that no earlier "
                                     "attempt reported")

        env = {
            **os.environ, **checkpoint_store.aws_env(), **trainer.extra_env,
            "CKPT_ATTEMPT": str(attempt), "CKPT_DAGSTER_RUN_ID": context.run.run_id,
            "CKPT_ROOT_RUN_ID": root_run_id, "CKPT_EXIT_WITH_PARENT": "1",
            "CKPT_STORE_URI": store.uri, "PYTHONUNBUFFERED": "1",
        }
        if code_version:
            env["CKPT_CODE_VERSION"] = code_version
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        cmd = [trainer.python, "-m", "trainer", "--config", str(config_path),
               "--store", store.uri, "--resume", "auto", "--log-level", trainer.log_level]

        att = _Attempt()
        rc, interrupted = _run_trainer(context, cmd, env, trainer, att, tracker, run, open_tracking,
                                       extras={"training_run": run, "experiment": reg.experiment,
                                               "attempt": attempt})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    ptr = _pointer(repo)
    last_step = ptr.step if ptr and ptr.checkpoint else None
    last_uri = repo.uri(ptr.checkpoint) if ptr and ptr.checkpoint else None
    if last_step is None and att.checkpoints:
        last_step, last_uri = att.checkpoints[-1]["step"], att.checkpoints[-1]["uri"]
    fclass = "success" if rc == 0 else failure_class_for(rc, att.failed)
    sig = _signal_name(rc) if rc != 0 else None
    ended = {"exit_code": int(rc), "failure_class": fclass, "last_committed_step": last_step,
             "checkpoint_uri": last_uri, "attempt": attempt, "training_run": run,
             "signal": sig, "dagster_run_id": context.run.run_id, "root_run_id": root_run_id,
             "parent_run_id": parent_run_id,
             "resumed_from_step": (att.started or {}).get("resumed_from_step"),
             "checkpoints_this_attempt": len(att.checkpoints),
             "interrupted": interrupted is not None, "mlflow_run_id": tracker.run_id}
    context.log_event(dg.AssetObservation(
        asset_key=MODEL_CHECKPOINT_KEY, partition=run, metadata=to_metadata(
            {"event": "attempt_ended", **ended}),
        description=f"attempt {attempt} ended: exit {rc} ({fclass})"))

    if interrupted is not None:
        tracker.finish("KILLED")
        context.log.warning(f"run interrupted; trainer exited {rc}; last committed step "
                            f"{last_step} ({last_uri})")
        raise interrupted
    if rc != 0:
        tracker.finish("FAILED")
        msg = (att.failed or {}).get("message")
        desc = (f"trainer exited {rc} ({fclass}{', ' + sig if sig else ''}) in attempt "
                f"{attempt} of training run {run}; last committed step {last_step}"
                f"{' (' + last_uri + ')' if last_uri else ''}" + (f": {msg}" if msg else ""))
        extra = {k: ended[k] for k in ("signal", "dagster_run_id", "root_run_id",
                                       "resumed_from_step", "checkpoints_this_attempt")}
        extra["error_type"] = (att.failed or {}).get("error_type")
        extra["message"] = msg
        raise fail(desc, exit_code=rc, failure_class=fclass, run=run, attempt=attempt,
                   last_committed_step=last_step, checkpoint_uri=last_uri, **extra)

    # Success: the pointer names the final checkpoint.
    if not ptr or not ptr.checkpoint:
        raise fail(f"trainer exited 0 but {repo.pointer_key} names no checkpoint",
                   exit_code=0, failure_class="error", run=run, attempt=attempt)
    m = repo.read_manifest(ptr.checkpoint)
    lin = m.meta.get("lineage") or {}
    record = {"checkpoint": m.name, "uri": repo.uri(m.name), "step": m.step, "sha256": m.sha256,
              "size": m.total_size, "attempt": m.attempt, "parent": m.parent,
              "loss": m.meta.get("loss"), "eval": m.meta.get("metrics") or {},
              "experiment": reg.experiment, "training_run": run,
              "dagster_run_id": lin.get("dagster_run_id"),
              "root_run_id": lin.get("root_run_id"), "code_version": lin.get("code_version"),
              "data_version": lin.get("data_version")}
    tracker.set_tags({"final_checkpoint": record["uri"], "final_step": m.step})
    yield dg.Output(
        record,
        data_version=dg.DataVersion(m.sha256),
        metadata=to_metadata({
            "step": m.step, "uri": record["uri"], "name": m.name, "sha256": m.sha256,
            "size": m.total_size, "loss": record["loss"], "parent": m.parent,
            "parent_checkpoint": m.parent, "eval": record["eval"] or None,
            "experiment": reg.experiment, "training_run": run,
            "dagster_run_id": context.run.run_id, "checkpoint_dagster_run_id": lin.get("dagster_run_id"),
            "root_run_id": root_run_id, "attempt": attempt, "checkpoint_attempt": m.attempt,
            "resumed_from_step": (att.started or {}).get("resumed_from_step"),
            "code_version": lin.get("code_version") or code_version,
            "data_version": lin.get("data_version") or data_version,
            "checkpoints_this_attempt": len(att.checkpoints), "mlflow_run_id": tracker.run_id,
        }),
    )


def _run_trainer(context, cmd, env, trainer: TrainerResource, att: _Attempt,
                 tracker: MlflowTracker, run: str, after_start, extras: dict[str, Any]):
    """Start the trainer under a Pipes session; turn its messages into events; return
    (exit code, the interrupt exception if the run was interrupted)."""
    interrupted: BaseException | None = None
    seen = 0

    def handle(msgs: list[Any]) -> None:
        for msg in msgs:
            if not isinstance(msg, dict):
                continue
            kind = msg.get("type")
            if kind == "checkpoint":
                att.checkpoints.append(msg)
                context.log_event(dg.AssetMaterialization(
                    asset_key=MODEL_CHECKPOINT_KEY, partition=run,
                    description=f"checkpoint step {msg.get('step')} committed",
                    metadata=to_metadata(checkpoint_metadata(msg, run))))
                tracker.on_checkpoint(msg)
            elif kind == "eval":
                tracker.on_eval(msg)
            elif kind == "started":
                att.started = msg
                context.log.info(
                    f"trainer attempt {msg.get('attempt')} started"
                    + (f", resumed from step {msg['resumed_from_step']} ({msg.get('resumed_from')})"
                       if msg.get("resumed_from_step") is not None else " from scratch"))
                for s in msg.get("skipped") or []:
                    context.log.warning(f"CHECKPOINT FALLBACK: {s.get('checkpoint')} skipped: "
                                        f"{s.get('reason')}")
            elif kind == "failed":
                att.failed = msg
            elif kind == "stopped":
                att.stopped = msg
            elif kind == "finished":
                att.finished = msg
            elif kind == "progress":
                context.log.debug(f"trainer progress: step {msg.get('step')} loss {msg.get('loss')}")

    with dg.open_pipes_session(context=context,
                               context_injector=dg.PipesTempFileContextInjector(),
                               message_reader=dg.PipesTempFileMessageReader(),
                               extras=extras) as session:
        proc = subprocess.Popen(
            cmd, env={**env, **session.get_bootstrap_env_vars()}, cwd=trainer.cwd,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, bufsize=1, errors="replace",
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            start_new_session=True)
        context.log.info(f"trainer started (pid {proc.pid}): {' '.join(cmd)}")

        def pump() -> None:
            for line in proc.stdout:
                line = line.rstrip()
                if line:
                    context.log.info(f"[trainer] {line}")

        reader = threading.Thread(target=pump, name="trainer-output", daemon=True)
        reader.start()
        try:
            # MLflow's start-up (schema migrations on a new database) runs on its own thread,
            # so that an interrupt (which Dagster raises in the main thread) never lands
            # inside it; the main thread only waits, and waiting is safe to interrupt.
            opener = threading.Thread(target=after_start, name="mlflow-open", daemon=True)
            opener.start()
            while opener.is_alive():
                opener.join(0.1)
                if proc.poll() is not None:
                    opener.join(30)
                    break
            while True:
                rc = proc.poll()
                msgs = session.get_custom_messages()
                handle(msgs[seen:])
                seen = len(msgs)
                if rc is not None:
                    break
                time.sleep(0.2)
        except BaseException as e:  # DagsterExecutionInterruptedError (terminate), Ctrl-C, ...
            interrupted = e
            rc = _stop(context, proc, trainer.grace_period_seconds)
        reader.join(10)
    # The session is closed: every message the trainer wrote has been read.
    handle(session.get_custom_messages()[seen:])
    return rc, interrupted


def _stop(context, proc: subprocess.Popen, grace: float) -> int:
    """SIGTERM the trainer (it commits a checkpoint and exits 143); SIGKILL after `grace`."""
    if proc.poll() is None:
        context.log.warning(f"interrupted: SIGTERM to trainer pid {proc.pid}, grace {grace:.0f}s")
        proc.send_signal(signal.SIGTERM)
    while True:
        try:
            return proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            context.log.warning(f"trainer pid {proc.pid} still running after {grace:.0f}s: SIGKILL")
            proc.kill()
        except BaseException:  # a second interrupt while waiting: do not leave it running
            proc.kill()


# -- final_model --------------------------------------------------------------------------------

@dg.asset(
    partitions_def=training_runs,
    io_manager_key=IO_MANAGER_KEY,
    group_name=GROUP,
    code_version="final_model.v1",
    kinds={"pytorch", "mlflow"},
    metadata={"ckpt/store_dir": "models", "ckpt/filename": "model"},
    description="The final checkpoint's model weights, evaluated on the held-out split, "
                "stored under <experiment>/<run>/models/ and logged to MLflow.",
)
def final_model(context: dg.AssetExecutionContext, config: TrainingRunConfig,
                model_checkpoint: dict, checkpoint_store: CheckpointStore,
                mlflow_tracking: MLflowResource):
    import torch

    from trainer.task import build_task

    reg = resolve_registration(context, checkpoint_store, config)
    cfg = reg.config
    ck = model_checkpoint.get(CHECKPOINT_KEY) or {}
    task_args = {k: v for k, v in cfg["task_args"].items() if k != "data_path"}
    torch.set_num_threads(int(cfg.get("threads") or 1))
    try:
        task = build_task(cfg["task"], task_args, int(cfg["seed"]))
        task.model.load_state_dict(model_checkpoint["model"])
    except (ConfigError, RuntimeError, KeyError) as e:
        raise fail(f"cannot rebuild the model of {reg.run} from its registered config and "
                   f"checkpoint {ck.get('uri')}: {e}", exit_code=3,
                   failure_class="checkpoint_unloadable", run=reg.run,
                   last_committed_step=ck.get("step"), checkpoint_uri=ck.get("uri")) from e
    task.model.eval()
    metrics = {k: float(v) for k, v in task.eval_fn(task.model).items()}
    recorded = ck.get("metrics") or {}
    lineage = ck.get("lineage") or {}
    if lineage.get("data_version") and task.data_version != lineage["data_version"]:
        context.log.warning(f"held-out data version {task.data_version} differs from the "
                            f"checkpoint's data version {lineage['data_version']}")
    weights = {k: v.detach().cpu().contiguous() for k, v in task.model.state_dict().items()}
    num_classes = next((int(v.shape[0]) for v in reversed(list(weights.values())) if v.dim() == 2),
                       None)

    tracker = MlflowTracker(mlflow_tracking, reg.experiment, reg.run, context.log)
    mlflow_run_id = tracker.start({"final_checkpoint": ck.get("uri")})
    model_version = None
    with tempfile.TemporaryDirectory(prefix="ckpt-final-") as tmp:
        path = Path(tmp) / "model.pt"
        torch.save(weights, path)
        import hashlib

        weights_sha = hashlib.sha256(path.read_bytes()).hexdigest()
        model_version = tracker.log_final_model(
            str(path), {f"eval_{k}": v for k, v in metrics.items()}, int(ck.get("step") or 0),
            description=f"{reg.experiment}/{reg.run} step {ck.get('step')} from {ck.get('uri')}")
    tracker.finish("FINISHED")

    value = {"model": weights, "task": cfg["task"], "task_args": task_args,
             "seed": int(cfg["seed"]), "step": int(ck.get("step") or 0), "eval": metrics,
             "num_classes": num_classes, "checkpoint": ck.get("uri"),
             "checkpoint_sha256": ck.get("sha256"), "experiment": reg.experiment,
             "training_run": reg.run, "data_version": task.data_version,
             "config": json.dumps(cfg, sort_keys=True)}
    return dg.Output(
        value,
        data_version=dg.DataVersion(weights_sha),
        metadata=to_metadata({
            "eval_loss": metrics.get("loss"), "eval_accuracy": metrics.get("accuracy"),
            "recorded_eval_loss": recorded.get("loss"),
            "recorded_eval_accuracy": recorded.get("accuracy"),
            "step": int(ck.get("step") or 0), "checkpoint_uri": ck.get("uri"),
            "checkpoint_sha256": ck.get("sha256"), "weights_sha256": weights_sha,
            "num_classes": num_classes, "experiment": reg.experiment, "training_run": reg.run,
            "data_version": task.data_version, "code_version": git_commit(),
            "fallback_skipped": ck.get("skipped") or None,
            "mlflow_run_id": mlflow_run_id, "mlflow_model_version": model_version,
        }),
    )


TRAINING_ASSETS = [training_dataset, model_checkpoint, final_model]
