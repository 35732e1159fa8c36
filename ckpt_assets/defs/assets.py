"""The three assets of a training run: training_dataset -> model_checkpoint -> final_model.

All are partitioned by `training_runs` (partition key = run name). The training config of
a run is registered once (`ckpt_assets.base.registration`); every asset of every attempt reads the
registered config. A run's first launch may carry it in the run config:

    ops:
      training_dataset:
        config:
          experiment: demo                 # optional
          training: {max_steps: 200, dataset: s3://bucket/data/, task: pkg.mod:build}

A config names a `task` (the trainer runs its loop) or a `command` (the user's own script,
checkpointing through `trainer.CheckpointSession`); `model_checkpoint` treats both alike.
"""


import tempfile
import warnings
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import dagster as dg

from ckpt_assets.attempt.command import (
    AttemptIds,
    attempt_mtbf,
    base_env,
    command_launch,
    contract,
    standing_launch,
    task_launch,
)
from ckpt_assets.attempt.errors import TrainerStartError
from ckpt_assets.attempt.in_run import consider_relaunch, record_relaunch, serve_backoff
from ckpt_assets.attempt.k8s_pod import attempt_trainer
from ckpt_assets.attempt.messages import (
    AttemptReport,
    attempt_failure,
    catch_up_tracking,
    failure_description,
    link_resume,
    record_end,
    record_unseen_checkpoints,
)
from ckpt_assets.attempt.prefetch import prefetch_end_of_run_imports
from ckpt_assets.attempt.process import Attempt, run_under_pipes
from ckpt_assets.attempt.transport import pipes_channels
from ckpt_assets.attempt.warm_start import WarmTrainer
from ckpt_assets.base.datasets import DatasetRecord, describe_dataset, refuse_changed_data
from ckpt_assets.base.end import (
    AttemptEnd,
    bad_input,
    checkpoint_unloadable,
    storage_unavailable,
)
from ckpt_assets.base.events import MODEL_CHECKPOINT_KEY
from ckpt_assets.base.metadata import checkpoint_metadata, links, to_metadata
from ckpt_assets.base.registration import Registration
from ckpt_assets.base.tags import TAG_PARENT_RUN_ID, TAG_ROOT_RUN_ID
from ckpt_assets.defs.io_managers import CHECKPOINT_KEY, LoadedCheckpoint
from ckpt_assets.defs.partitions import training_runs
from ckpt_assets.defs.resources import CheckpointStore, MLflowResource, TrainerResource, git_commit
from ckpt_assets.lifecycle.ended import named_end
from ckpt_assets.lifecycle.model import Event
from ckpt_assets.lifecycle.settings import ResumeSettings
from ckpt_assets.lifecycle.transition import transition
from ckpt_assets.mlflow.tracking import MlflowTracker
from ckpt_assets.records.history import history_metadata, loss_history
from ckpt_assets.runs.training_run import TrainingRunConfig, attempt_number, resolve_registration
from trainer.base.errors import ConfigError, StorageError
from trainer.checkpoints.records import CheckpointRecord
from trainer.checkpoints.repo import CheckpointRepo

# Output(data_version=...) and Pipes' writer count are marked beta/preview in 1.13.
warnings.filterwarnings("ignore", category=dg.BetaWarning, message=".*data_version.*")
warnings.filterwarnings("ignore", category=dg.PreviewWarning, message=".*expected_writer_count.*")

IO_MANAGER_KEY = "checkpoint_io_manager"
GROUP = "training"

__all__ = ["MODEL_CHECKPOINT_KEY", "TRAINING_ASSETS", "TrainingRunConfig", "final_model",
           "model_checkpoint", "training_dataset"]


@dg.asset(
    partitions_def=training_runs,
    io_manager_key=IO_MANAGER_KEY,
    group_name=GROUP,
    code_version="training_dataset.v2",
    kinds={"dataset"},
    metadata={"ckpt/store_dir": "assets/training_dataset", "ckpt/filename": "dataset"},
    description="What the run trains on, by reference: the dataset URI (local path or s3:// "
                "prefix) with its content manifest, or the task's generated data. Its version "
                "is recorded in every checkpoint's lineage; a changed dataset is refused.",
)
def training_dataset(context: dg.AssetExecutionContext, config: TrainingRunConfig,
                     checkpoint_store: CheckpointStore, trainer: TrainerResource):
    reg = resolve_registration(context, checkpoint_store, config)
    uri = reg.config.dataset or ""
    try:
        client = checkpoint_store.s3_client() if uri.startswith("s3://") else None
        record, files = describe_dataset(reg, s3_client=client)
        refuse_changed_data(CheckpointRepo(checkpoint_store.open(), reg.experiment, reg.run),
                            record)
    except ConfigError as e:
        raise bad_input(str(e), reg.run) from e
    except StorageError as e:
        raise storage_unavailable(str(e), reg.run) from e
    if _trains_after(context):  # the data is good: this run trains next
        _warm_up(context, reg, checkpoint_store, trainer)
    return dg.Output(
        {**record.to_dict(), "manifest": files},
        data_version=dg.DataVersion(record.version),
        metadata=to_metadata({
            "data_version": record.version, "kind": record.kind, "uri": record.uri,
            "files": record.files, "bytes": record.bytes, "generator": record.generator,
            "experiment": reg.experiment, "training_run": reg.run,
            "config_uri": reg.config_uri}),
    )


@dg.asset(
    partitions_def=training_runs,
    io_manager_key=IO_MANAGER_KEY,
    group_name=GROUP,
    code_version="model_checkpoint.v2",
    kinds={"pytorch"},
    metadata={"ckpt/load": "checkpoint_state"},
    description="Trains (or resumes) the run: `python -m trainer` on its task, or its own "
                "command, as a process under Dagster Pipes. Each committed checkpoint is an "
                "observation (step, loss, lineage); a finished run materializes the partition "
                "with its final checkpoint. As an input it loads the newest valid checkpoint.",
)
def model_checkpoint(context: dg.AssetExecutionContext, config: TrainingRunConfig,
                     training_dataset: dict, checkpoint_store: CheckpointStore,
                     trainer: TrainerResource, mlflow_tracking: MLflowResource):
    reg = resolve_registration(context, checkpoint_store, config)
    store = checkpoint_store.open()
    repo = CheckpointRepo(store, reg.experiment, reg.run)
    ids = AttemptIds(attempt_number(context, repo), context.run.run_id,
                     context.run.tags.get(TAG_ROOT_RUN_ID) or context.run.run_id, git_commit())
    dataset = DatasetRecord.from_dict(training_dataset)
    # The move `attempt started`, from the run as it stood before Dagster started it
    # (NOT_STARTED reads as QUEUED does, and, unlike it, needs no launch origin).
    transition(context.instance, reg.run, Event.ATTEMPT_STARTED,
               lambda w: link_resume(w, context.run, context.log, store),
               run=context.run.with_status(dg.DagsterRunStatus.NOT_STARTED), context=context)
    # Before this attempt commits anything: what earlier attempts committed unseen.
    seen = record_unseen_checkpoints(context, repo, reg.run)
    # The step's, for every attempt it runs: the deployment's, with the run's own keys.
    settings = ResumeSettings.from_env().for_run(reg.config.resume)
    warm = _warm_up(context, reg, checkpoint_store, trainer)  # unless the first step did
    step = _Step(context, reg, repo, dataset, checkpoint_store, trainer, mlflow_tracking,
                 settings, warm, seen)
    try:
        while True:
            ended, tracker, relaunch = _one_attempt(step, ids)
            if relaunch is None:
                break
            # The trainer died, its worker (this step) lives, and the policy resumes it:
            # the next attempt starts here, in this run (`ckpt_assets.attempt.in_run`).
            record_relaunch(context, ended, relaunch)
            serve_backoff(relaunch)
            ids = replace(ids, attempt=_next_attempt(repo, ended.attempt))
    finally:
        warm.close()
    transition(context.instance, reg.run, Event.FINISHED, context=context,
               detail=f"attempt {ended.attempt} trained to step {ended.last_committed_step}")
    # The run's history across attempts, on the output people open last.
    yield _final_output(repo, ended, tracker, context, history_metadata(
        context.instance, reg.run, seen, context.log))


def _trains_after(context: dg.AssetExecutionContext) -> bool:
    """Whether this run goes on to train (not a run of the dataset alone)."""
    steps = context.run.step_keys_to_execute
    return (MODEL_CHECKPOINT_KEY in context.job_def.asset_layer.selected_asset_keys
            and (steps is None or model_checkpoint.node_def.name in steps))


def _warm_up(context, reg, checkpoint_store: CheckpointStore,
             trainer: TrainerResource) -> WarmTrainer:
    """The run's warm trainer, with a standby for the first attempt started as soon as the
    run knows what it launches: its interpreter imports torch while the run worker prepares
    the attempt (`ckpt_assets.attempt.warm_start`). No standby for a pod: its interpreter is the
    image's."""
    warm = trainer.warm_trainer(context.log)
    if not trainer.in_pod:
        own = standing_launch(reg, base_env(trainer, checkpoint_store.aws_env()), trainer)
        warm.warm_up(own.argv, own.env, own.cwd)
    return warm


@dataclass(frozen=True)
class _Step:
    """What every attempt of one `model_checkpoint` step shares: the run, its store and
    resources, its warm trainer, and the checkpoints seen so far."""

    context: dg.AssetExecutionContext
    reg: Registration
    repo: CheckpointRepo
    dataset: DatasetRecord
    checkpoint_store: CheckpointStore
    trainer: TrainerResource
    mlflow_tracking: MLflowResource
    settings: ResumeSettings
    warm: WarmTrainer
    seen: list[CheckpointRecord]


def _one_attempt(step: _Step, ids: AttemptIds):
    """Run one attempt's process and record how it ended: (its AttemptEnd, its MLflow
    tracker, the policy's decision to relaunch it in this run or None). Raises the step's
    Failure (or interrupt) when the attempt failed and is not relaunched here."""
    context, reg, repo, seen = step.context, step.reg, step.repo, step.seen
    tracker = MlflowTracker(step.mlflow_tracking, reg.experiment, reg.run, context.log)
    report = AttemptReport(reg.run, ids.attempt)
    proc = _run_trainer(step, ids,
                        partial(_on_messages, report, context, tracker,
                                not reg.config.command),
                        partial(_open_tracking, context, tracker, repo, ids, step.dataset,
                                reg.config.to_dict()))
    # Once more at the end: an orphaned trainer of an earlier attempt may have committed
    # after the first look and before this attempt's trainer claimed the run.
    seen.extend(report.checkpoints)
    late = record_unseen_checkpoints(context, repo, reg.run, known={r.name for r in seen})
    seen.extend(late)
    if late:  # committed, never reported (its report lost): MLflow's history gets them too
        tracker.catch_up(late)
    ended = report.outcome(repo, proc, context)
    ended = named_end(context.instance.get_run_by_id(context.run.run_id) or context.run, ended)
    relaunch = consider_relaunch(context, ended, proc, step.settings)
    _record_end(context, ended, proc, tracker, report, relaunching=relaunch is not None)
    return ended, tracker, relaunch


def _on_messages(report: AttemptReport, context, tracker: MlflowTracker, evaluates: bool,
                 msgs: list) -> None:
    report.handle(context, tracker, msgs)
    if msgs and report.near_its_end():  # past its start-up, and near the run's end
        prefetch_end_of_run_imports(evaluates)


def _next_attempt(repo: CheckpointRepo, ended: int) -> int:
    """The attempt after `ended`, or later if the store already holds that one."""
    try:
        return max(ended + 1, repo.next_attempt())
    except StorageError as e:
        raise storage_unavailable(str(e), repo.run) from e


def _run_trainer(step: _Step, ids: AttemptIds, on_messages, after_start):
    """Start the attempt's process (the task's trainer or the run's command) under Pipes,
    told the contract of the run it trains, and wait for it; bad launches are bad input."""
    context, reg, repo, dataset = step.context, step.reg, step.repo, step.dataset
    checkpoint_store, trainer = step.checkpoint_store, step.trainer
    store = checkpoint_store.open()
    told = contract(reg, store.uri, ids, dataset, attempt_mtbf(context, store, reg))
    env = base_env(trainer, checkpoint_store.aws_env())
    extras = {"training_run": reg.run, "experiment": reg.experiment, "attempt": ids.attempt}
    with tempfile.TemporaryDirectory(prefix=f"ckpt-{reg.run}-a{ids.attempt}-") as workdir:
        try:
            trainer = attempt_trainer(context, reg, trainer, store.uri)
            launch = (command_launch(reg, repo, told, env, trainer, context.log)
                      if reg.config.command
                      else task_launch(reg, told, env, trainer, Path(workdir)))
            channels = pipes_channels(trainer, checkpoint_store)
            if trainer.in_pod:  # a Kubernetes pod (ckpt_assets.attempt.k8s_launch)
                from ckpt_assets.attempt.k8s_launch import run_in_pod

                return run_in_pod(context, launch, reg, trainer, store.uri, channels,
                                  on_messages, after_start, extras)
            return run_under_pipes(context, Attempt(
                launch.argv, launch.env, launch.cwd, trainer.grace_period_seconds,
                on_messages, after_start, extras, channels, step.warm))
        except TrainerStartError as e:
            raise bad_input(str(e), reg.run, attempt=ids.attempt) from e
        except StorageError as e:
            raise storage_unavailable(str(e), reg.run) from e


def _record_end(context, ended: AttemptEnd, proc, tracker: MlflowTracker,
                report: AttemptReport, relaunching: bool = False) -> None:
    """Record how the attempt ended (Dagster, MLflow); re-raise an interrupt, and fail the
    step with the attempt's record unless it finished the run or is relaunched in it."""
    record_end(context, ended, proc.interrupted is not None,
               {"parent_run_id": context.run.tags.get(TAG_PARENT_RUN_ID),
                "mlflow_run_id": tracker.run_id,
                **links({"checkpoint_uri": ended.checkpoint_uri, "mlflow_run": tracker.run_url})})
    if ended.outcome.failed:
        tracker.on_failure(ended.attempt, ended.outcome.value, failure_description(ended),
                           report.failed.traceback if report.failed else None)
    if proc.interrupted is not None:
        tracker.finish("KILLED")
        context.log.warning(f"run interrupted; the training process exited "
                            f"{proc.returncode}; last committed step "
                            f"{ended.last_committed_step} ({ended.checkpoint_uri})")
        raise proc.interrupted
    if ended.outcome.failed:
        tracker.finish("FAILED")
        if not relaunching:
            raise attempt_failure(ended, report)


def _open_tracking(context, tracker: MlflowTracker, repo: CheckpointRepo, ids: AttemptIds,
                   dataset: DatasetRecord, config: dict) -> None:
    """Called right after the process started: MLflow's start-up overlaps the trainer's,
    and no message is handled before the MLflow run is open."""
    run_id = tracker.start({
        "dagster_run_id": ids.dagster_run_id, "dagster_root_run_id": ids.root_run_id,
        "dagster_parent_run_id": context.run.tags.get(TAG_PARENT_RUN_ID),
        "attempt": ids.attempt, "attempts": ids.attempt, "code_version": ids.code_version,
        "data_version": dataset.version, "store": repo.store.uri})
    if run_id:
        context.log.info(f"MLflow run {run_id} ({tracker.run_url or tracker.resource.resolved_tracking_uri})")
        tracker.log_config(config)
        if caught_up := catch_up_tracking(tracker, context.instance, repo):
            context.log.info(f"MLflow: logged {caught_up} committed checkpoint(s) that its run "
                             "did not hold yet (committed before it opened)")


def _final_output(repo: CheckpointRepo, ended: AttemptEnd, tracker: MlflowTracker,
                  context, extra: dict) -> dg.Output:
    """The run's final checkpoint (the one the pointer names) as the step's output."""
    m = repo.read_manifest(repo.read_pointer().checkpoint)
    rec = CheckpointRecord.from_manifest(m, repo.uri(m.name))
    tracker.set_tags({"final_checkpoint": rec.uri, "final_step": rec.step})
    md = checkpoint_metadata(rec)
    md.update(to_metadata({
        "dagster_run_id": context.run.run_id, "attempt": ended.attempt,
        "checkpoint_dagster_run_id": rec.lineage.dagster_run_id if rec.lineage else None,
        "checkpoint_attempt": rec.attempt,
        "checkpoints_this_attempt": ended.checkpoints_this_attempt,
        "resumed_from_step": ended.resumed_from_step,
        "mlflow_run_id": tracker.run_id}) | links({"mlflow_run": tracker.run_url}) | extra)
    return dg.Output(rec.to_dict(), data_version=dg.DataVersion(rec.sha256), metadata=md)


@dg.asset(
    partitions_def=training_runs,
    io_manager_key=IO_MANAGER_KEY,
    group_name=GROUP,
    code_version="final_model.v2",
    kinds={"pytorch", "mlflow"},
    metadata={"ckpt/store_dir": "models", "ckpt/filename": "model"},
    description="The final checkpoint's `model` part: evaluated on the task's held-out data "
                "(task mode) or carrying the metrics the script recorded (command mode), stored "
                "under <experiment>/<run>/models/ and logged to MLflow.",
)
def final_model(context: dg.AssetExecutionContext, config: TrainingRunConfig,
                model_checkpoint: dict, checkpoint_store: CheckpointStore,
                mlflow_tracking: MLflowResource):
    from ckpt_assets.records.export import evaluate_final, export_weights

    reg = resolve_registration(context, checkpoint_store, config)
    loaded: LoadedCheckpoint = model_checkpoint[CHECKPOINT_KEY]
    ck = loaded.record
    weights = model_checkpoint.get("model")
    if not isinstance(weights, dict):
        raise checkpoint_unloadable(
            f"checkpoint {ck.uri} has no part named 'model'; final_model exports the "
            "part named 'model' (pass model=... to CheckpointSession.restore)", reg.run, ck)
    metrics, data_version = evaluate_final(reg, weights, ck, context.log)
    tracker = MlflowTracker(mlflow_tracking, reg.experiment, reg.run, context.log)
    mlflow_run_id = tracker.start({"final_checkpoint": ck.uri})
    # The last opening of the run: whatever an attempt whose MLflow start-up outlasted it
    # left out reaches the history here.
    catch_up_tracking(tracker, context.instance)
    value, weights_sha, model_version = export_weights(reg, weights, ck, metrics, tracker)
    # The run's history where people look for the model, in Dagster and in MLflow.
    history = loss_history(context.instance, reg.run, log=context.log)
    tracker.log_loss_plot(history.png)
    tracker.finish("FINISHED")
    return dg.Output(
        {**value, "data_version": data_version},
        data_version=dg.DataVersion(weights_sha),
        metadata=to_metadata({
            "eval_loss": metrics.get("loss"), "eval_accuracy": metrics.get("accuracy"),
            "recorded_eval_loss": ck.eval.get("loss"),
            "recorded_eval_accuracy": ck.eval.get("accuracy"),
            "step": ck.step, "checkpoint_uri": ck.uri,
            "checkpoint_sha256": ck.sha256, "weights_sha256": weights_sha,
            "num_classes": value["num_classes"], "experiment": reg.experiment,
            "training_run": reg.run, "data_version": data_version,
            "code_version": git_commit(), "fallback_skipped": [asdict(s) for s in loaded.skipped] or None,
            "mlflow_run_id": mlflow_run_id, "mlflow_model_version": model_version,
        }) | links({"checkpoint_uri": ck.uri, "mlflow_run": tracker.run_url})
        | history.metadata,
    )


TRAINING_ASSETS = [training_dataset, model_checkpoint, final_model]
