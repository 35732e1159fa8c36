"""The jobs: `train_job`, the `train_demo` preset of it, `check_training_run` and
`stop_training_run`.

`train_job`: the three training assets of one partition, in the run worker's process,
without their asset checks (those run in `check_training_run`, below).
`in_process_executor` on purpose: the asset body (and the Pipes session that owns the
trainer) runs in the run worker itself, so killing the run worker kills the step too, and
the trainer (started with PR_SET_PDEATHSIG and CKPT_EXIT_WITH_PARENT=1) commits and stops.
With the multiprocess executor an orphaned step process could keep training and write
events into a run that Dagster already marked failed.

Dagster's own run retries stay off (`dagster/max_retries: 0`, and run_retries is disabled
in dagster_home/dagster.yaml): resuming is the resume sensor's decision, made once per
failure.

`train_demo` is `train_job` with scripts/demo_config.json as its default run config: the
launchpad opens with the demo config filled in. It is a second job, not a default config on
`train_job`, because a job's default config is applied to every run of the job that does
not override it: the sensors' resumes and `ckpt-assets launch` of a registered run carry no
config, and would all register the demo config (refused for any other run, so every resume
would fail as bad input). A failed `train_demo` run is resumed as a `train_job` run.

`check_training_run`: the asset checks of the training assets alone, for one partition,
launched once per succeeded training run (why they are not in the training jobs:
ckpt_assets.defs.check_runs). It has no partitions definition (Dagster 1.13 infers none for a
selection of checks alone, and ignores one given): its run's `dagster/partition` tag is the
partition the partitioned checks evaluate on. By hand: launch it with that tag.

`stop_training_run` stops a training run for good from the UI (ckpt_assets.lifecycle.stop).

`new_training_run` starts a new training run from the launchpad: a name and a typed training
config (the same form as train_job's), registered as `ckpt-assets register` does, then
train_job queued for it as `ckpt-assets launch` does (`ckpt_assets.runs.submit`).

No `from __future__ import annotations`: Dagster reads the op's config annotation as a
class, not a string.
"""

import warnings

import dagster as dg
from pydantic import Field, ValidationError

from ckpt_assets.base.names import (
    CHECK_JOB,
    NEW_RUN_JOB,
    REPO_ROOT,
    STOP_JOB,
    TRAIN_DEMO_JOB,
    TRAIN_JOB,
)
from ckpt_assets.base.registration import register_training_run
from ckpt_assets.base.tags import TAG_NEW_RUN_TARGET, TAG_STOP_TARGET
from ckpt_assets.defs.assets import TRAINING_ASSETS
from ckpt_assets.defs.checks import TRAINING_CHECKS
from ckpt_assets.defs.resources import CheckpointStore
from ckpt_assets.lifecycle.stop import is_known, stop_training_run
from ckpt_assets.runs.launch_form import TrainingForm, training_from_form
from trainer.base.errors import ConfigError, StorageError
from trainer.config_file import read_config_file

DEMO_CONFIG = REPO_ROOT / "scripts" / "demo_config.json"
TRAINING_TAGS = {"dagster/max_retries": "0"}


def _training_job(name: str, description: str, config=None):
    return dg.define_asset_job(
        name,
        selection=dg.AssetSelection.assets(*TRAINING_ASSETS).without_checks(),
        executor_def=dg.in_process_executor,
        tags=TRAINING_TAGS,
        config=config,
        description=description,
    )


train_job = _training_job(
    TRAIN_JOB, "Train (or resume) one training run: dataset -> trainer via Pipes -> final model.")


def demo_run_config() -> dg.RunConfig:
    """scripts/demo_config.json on the training_dataset op (where a first launch's config
    goes), as written: the launchpad shows the keys the demo sets, the form the rest."""
    demo = read_config_file(DEMO_CONFIG)
    TrainingForm(**demo)  # typed here, so that a broken file is reported at load
    return dg.RunConfig(ops={"training_dataset": {"config": {"training": demo}}})


def _train_demo():
    try:
        config = demo_run_config()
    except (ConfigError, ValidationError, dg.DagsterError) as e:
        # A broken demo file must not take the code location (and auto-resume) down with it.
        warnings.warn(f"train_demo is not defined: {DEMO_CONFIG}: {e}", stacklevel=2)
        return None
    return _training_job(
        TRAIN_DEMO_JOB, "train_job with the demo config (scripts/demo_config.json) filled in: "
                      "pick or add a partition (the run name) and launch.", config)


train_demo = _train_demo()

check_training_run = dg.define_asset_job(
    CHECK_JOB,
    selection=dg.AssetSelection.checks(*TRAINING_CHECKS),
    executor_def=dg.in_process_executor,
    description="The asset checks of one training run (partition): the latest checkpoint "
                "verifies, its loss is finite, the final model meets the evaluation threshold. "
                "Launched by check_succeeded_training when a training run succeeds.",
)


class StopTrainingRunConfig(dg.Config):
    training_run: str = Field(description="the training run (partition key) to stop")
    reason: str | None = Field(default=None, description="why; kept on the stopped runs' tags")
    force: bool = Field(default=False, description="also mark its runs canceled at once, for a "
                        "run worker that is gone (as the UI's force termination does)")


@dg.op(description="Tags the training run's active runs not to be resumed, then terminates "
                   "them; withdraws a resume that is still pending.")
def stop_training_run_op(context: dg.OpExecutionContext, config: StopTrainingRunConfig) -> None:
    name = config.training_run
    try:
        if not is_known(context.instance, name):
            raise ConfigError(f"there is no training run {name!r} (no partition, no runs)")
        actions = stop_training_run(context.instance, name, config.reason, force=config.force)
    except ConfigError as e:
        raise dg.Failure(description=str(e), allow_retries=False) from None
    # Findable from the run list: which training run this stop was for.
    context.instance.add_run_tags(context.run_id, {TAG_STOP_TARGET: name})
    if not actions:
        context.log.info(f"training run {name!r} has nothing to stop: no active run, and no "
                         "resume pending")
    for action in actions:
        context.log.info(str(action))


@dg.job(
    name=STOP_JOB,
    executor_def=dg.in_process_executor,
    tags={"dagster/max_retries": "0"},
    description="Stop a training run for good: its active runs are terminated and never resumed.",
)
def stop_training_run_job():
    stop_training_run_op()


class NewTrainingRunConfig(dg.Config):
    name: str = Field(description="the new training run's name, its partition key: lowercase "
                      "letters, digits, '.', '_', '-', starting with a letter or digit, at most "
                      "64 characters")
    training: TrainingForm = Field(
        default_factory=TrainingForm,
        description="Training config (the trainer's JSON/YAML config), registered once for the "
                    "run; keys left out take the trainer's defaults.")
    experiment: str | None = Field(
        default=None, description="Experiment of the run (default: the config's, else 'default').")


@dg.op(description="Registers the training run (as `ckpt-assets register`), then queues a "
                   "train_job run for it (as `ckpt-assets launch`).")
def new_training_run_op(context: dg.OpExecutionContext, config: NewTrainingRunConfig,
                        checkpoint_store: CheckpointStore) -> dg.Output:
    from ckpt_assets.lifecycle.rerun import rerun_tags
    from ckpt_assets.runs.submit import SubmitError, launch_training_run

    name = config.name
    try:
        reg = register_training_run(checkpoint_store.open(), name,
                                    training_from_form(config.training), config.experiment,
                                    instance=context.instance, may_correct=True)
        launch = launch_training_run(context.instance, name, rerun_tags(context.instance, name))
    except ConfigError as e:  # a bad name or config, or one that contradicts the registered
        raise dg.Failure(description=str(e), allow_retries=False) from None
    except (StorageError, SubmitError) as e:
        raise dg.Failure(description=f"training run {name!r} was not launched: {e}",
                         allow_retries=False) from None
    context.instance.add_run_tags(context.run_id, {TAG_NEW_RUN_TARGET: name})
    run = launch.run
    what = "launched" if launch.created else "already has an active run"
    context.log.info(f"training run {name!r} (experiment {reg.experiment}) {what}: train_job "
                     f"run {run.run_id} ({run.status.value})")
    return dg.Output(None, metadata={
        "training_run": name, "experiment": reg.experiment, "config_uri": reg.config_uri,
        "train_job_run": dg.MetadataValue.dagster_run(run.run_id), "created": launch.created})


@dg.job(
    name=NEW_RUN_JOB,
    executor_def=dg.in_process_executor,
    tags={"dagster/max_retries": "0"},
    description="Start a new training run by name: registers its config and launches "
                "train_job for it (later attempts and resumes need no config).",
)
def new_training_run_job():
    new_training_run_op()


JOBS = [job for job in (train_job, train_demo, check_training_run, stop_training_run_job,
                        new_training_run_job) if job is not None]
