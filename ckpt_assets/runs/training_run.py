"""The training run behind an asset execution: its registered config and attempt number."""

from __future__ import annotations

import dagster as dg
from pydantic import Field

from ckpt_assets.base.end import bad_input, storage_unavailable
from ckpt_assets.base.queries import training_runs_of
from ckpt_assets.base.registration import (
    Registration,
    read_registration,
    register_training_run,
    validate_partition_key,
)
from ckpt_assets.base.store import StoreSource
from ckpt_assets.base.view import RunView
from ckpt_assets.runs.launch_form import TrainingForm, training_from_form
from ckpt_assets.runs.world import at_world
from trainer.base.errors import ConfigError, StorageError
from trainer.checkpoints.repo import CheckpointRepo


class TrainingRunConfig(dg.Config):
    """Run config of the training assets. Needed only for a run's first launch."""

    # Typed from the trainer's own models (ckpt_assets.runs.launch_form): the launchpad shows each
    # key's help and default and refuses an unknown key. Optional: later launches, and every
    # resume the sensors launch, carry none and read the registered config.
    training: TrainingForm | None = Field(
        default=None,
        description="Training config (the trainer's JSON/YAML config). Registered on the first "
                    "launch of the run; later launches may omit it and must not change it. "
                    "Keys left out take the trainer's defaults.")
    experiment: str | None = Field(
        default=None, description="Experiment of the run (default: the config's, else 'default').")


def partition_key(context) -> str:
    try:
        return validate_partition_key(context.partition_key)
    except ConfigError as e:
        raise bad_input(str(e), str(context.partition_key)) from e


def _given_config(context, config: TrainingRunConfig) -> tuple[dict | None, str | None]:
    """The training config this launch carries, on any of the run's training ops."""
    if config.training is not None:
        return training_from_form(config.training), config.experiment
    # Another op's config, as submitted: the same keys (those left out normalize to the
    # same defaults at registration).
    for op in (context.run.run_config or {}).get("ops", {}).values():
        other = (op or {}).get("config") or {}
        if other.get("training") is not None:
            return other["training"], config.experiment or other.get("experiment")
    return None, config.experiment


def resolve_registration(context, checkpoint_store: StoreSource,
                         config: TrainingRunConfig) -> Registration:
    """Register the run's config if this launch carries one, else read the registered one;
    at the world size this run's launch asked for (`runs.world.at_world`)."""
    run = partition_key(context)
    try:
        return at_world(_registered(context, checkpoint_store, config, run),
                        RunView.of(context.run).world)
    except ConfigError as e:
        raise bad_input(str(e), run) from e
    except StorageError as e:
        raise storage_unavailable(str(e), run) from e


def _registered(context, checkpoint_store: StoreSource, config: TrainingRunConfig,
                run: str) -> Registration:
    training, experiment = _given_config(context, config)
    store = checkpoint_store.open()
    if training is not None:
        reg = register_training_run(store, run, training, experiment)
        if reg.created:
            context.log.info(f"registered training run {run!r}: {reg.config_uri}")
        return reg
    reg = read_registration(store, run)
    if reg is None:
        raise ConfigError(
            f"training run {run!r} has no registered config in {store.uri}. Launch its "
            "first run with ops.training_dataset.config.training set to the training "
            f"config, or run: python -m ckpt_assets register {run} --config FILE")
    if experiment and experiment != reg.experiment:
        raise ConfigError(f"training run {run!r} is registered in experiment "
                          f"{reg.experiment!r}, not {experiment!r}")
    return reg


def count_earlier_attempts(instance: dg.DagsterInstance, run_id: str, key: str) -> int:
    """Earlier training runs of this partition."""
    runs = training_runs_of(instance, key)  # newest first
    ids = [r.run_id for r in runs]
    return len(runs[ids.index(run_id) + 1:] if run_id in ids else runs)


def attempt_number(context, repo: CheckpointRepo) -> int:
    """The attempt this run asks for: its tag (set by the resume sensor), else one more than
    the partition's earlier runs. The trainer's claim makes it unique in the store."""
    view = RunView.of(context.run)
    attempt = view.attempt if view.attempt_tagged else 1 + count_earlier_attempts(
        context.instance, context.run.run_id, repo.run)
    try:
        in_store = repo.next_attempt()
    except StorageError as e:
        raise storage_unavailable(str(e), repo.run) from e
    if in_store > attempt:
        context.log.warning(f"the store already holds attempt {in_store - 1} of {repo.run}; "
                            f"this attempt is numbered {in_store} instead of {attempt}")
    return max(attempt, in_store)
