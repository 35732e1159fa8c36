"""Asset checks of a training run, evaluated per partition (the run's name).

They are not part of the training jobs: a training run is interrupted routinely (a
preemption ends its Dagster run as failed and a resume follows as a new run), and checks
planned inside such a run would be recorded as "execution failed" for every interrupted
attempt. They run in their own job, `check_training_run`, which the sensor in
`ckpt_assets.defs.check_runs` launches once for every training run that succeeds, for its
partition; the evaluations are recorded on that partition.

* `latest_checkpoint_verifies`: the checkpoint latest.json names exists and every file
  matches its manifest's size and SHA-256.
* `latest_checkpoint_loss_is_finite`: that checkpoint's training loss is a finite number.
* `final_model_meets_eval_loss_threshold`: the stored final model's held-out loss is at
  most `max_eval_loss` (check config; default: chance level, ln(number of classes)).
* `training_run_state`: the run's state and its reason (`ckpt_assets.lifecycle.state`); fails for
  a run stopped for good. The resume sensors and stops also record it when they end a run.
"""

import math
import warnings

import dagster as dg
from pydantic import Field

from ckpt_assets.base.registration import read_registration, validate_partition_key
from ckpt_assets.defs.assets import final_model, model_checkpoint
from ckpt_assets.defs.partitions import training_runs
from ckpt_assets.defs.resources import CheckpointStore
from ckpt_assets.lifecycle.state import STATE_CHECK, run_state, state_check_result
from ckpt_assets.records.asset_versions import StoredObjectError, VersionedRepo
from trainer.base.errors import CheckpointError, CheckpointNotFoundError, StorageError
from trainer.checkpoints.repo import CheckpointRepo

# Partitioned checks (an evaluation per training run, not one for the asset as a whole) are
# a preview feature of Dagster 1.13 (pinned in constraints.txt); tests/orchestrator/test_checks.py pins
# the behaviour we rely on.
warnings.filterwarnings("ignore", category=dg.PreviewWarning,
                        message=".*partitions_def on an AssetCheckSpec.*")


def _run_repo(context, checkpoint_store: CheckpointStore):
    """(partition key, store, registration) or an AssetCheckResult explaining why not."""
    try:
        key = validate_partition_key(context.partition_key)
    except Exception as e:  # not a partitioned run, or a bad key
        return dg.AssetCheckResult(passed=False, description=(
            f"no usable partition key: {e} (to check a training run by hand, launch "
            "check_training_run with the tag dagster/partition=<training run>)"))
    try:
        store = checkpoint_store.open()
        reg = read_registration(store, key)
    except (StorageError, CheckpointError) as e:
        return dg.AssetCheckResult(passed=False, description=str(e))
    if reg is None:
        return dg.AssetCheckResult(passed=False, description=f"training run {key!r} is not registered")
    return key, store, reg


def _latest_manifest(context, checkpoint_store: CheckpointStore, verify: bool):
    """(repo, manifest) of the checkpoint latest.json names, or the failed check result."""
    got = _run_repo(context, checkpoint_store)
    if isinstance(got, dg.AssetCheckResult):
        return got
    key, store, reg = got
    repo = CheckpointRepo(store, reg.experiment, key)
    try:
        ptr = repo.read_pointer()
        if not ptr or not ptr.checkpoint:
            return dg.AssetCheckResult(passed=False, description="no committed checkpoint yet")
        read = repo.verify if verify else repo.read_manifest
        return repo, read(ptr.checkpoint)
    except (CheckpointError, CheckpointNotFoundError, StorageError) as e:
        return dg.AssetCheckResult(passed=False, description=str(e),
                                   metadata={"error": dg.MetadataValue.text(str(e))})


@dg.asset_check(asset=model_checkpoint, partitions_def=training_runs,
                description="The checkpoint latest.json names verifies "
                "(every file's size and SHA-256 match its manifest).")
def latest_checkpoint_verifies(context: dg.AssetCheckExecutionContext,
                               checkpoint_store: CheckpointStore) -> dg.AssetCheckResult:
    got = _latest_manifest(context, checkpoint_store, verify=True)
    if isinstance(got, dg.AssetCheckResult):
        return got
    repo, m = got
    return dg.AssetCheckResult(passed=True, metadata={
        "checkpoint_uri": dg.MetadataValue.text(repo.uri(m.name)), "step": m.step,
        "sha256": m.sha256, "size": m.total_size})


@dg.asset_check(asset=model_checkpoint, partitions_def=training_runs,
                description="The latest checkpoint's training loss is finite.")
def latest_checkpoint_loss_is_finite(context: dg.AssetCheckExecutionContext,
                                     checkpoint_store: CheckpointStore) -> dg.AssetCheckResult:
    got = _latest_manifest(context, checkpoint_store, verify=False)
    if isinstance(got, dg.AssetCheckResult):
        return got
    repo, m = got
    loss = m.meta.get("loss")
    ok = isinstance(loss, int | float) and math.isfinite(loss)
    return dg.AssetCheckResult(passed=ok, metadata={
        "loss": dg.MetadataValue.text(str(loss)) if not ok else float(loss), "step": m.step,
        "checkpoint_uri": dg.MetadataValue.text(repo.uri(m.name))})


class EvalLossThreshold(dg.Config):
    max_eval_loss: float | None = Field(
        default=None, description="Largest acceptable held-out loss; default: chance level "
                                  "ln(number of classes)")


@dg.asset_check(asset=final_model, partitions_def=training_runs,
                description="The final model's held-out loss is at most "
                "max_eval_loss (default: chance level, ln(number of classes)).")
def final_model_meets_eval_loss_threshold(context: dg.AssetCheckExecutionContext,
                                          config: EvalLossThreshold,
                                          checkpoint_store: CheckpointStore) -> dg.AssetCheckResult:
    got = _run_repo(context, checkpoint_store)
    if isinstance(got, dg.AssetCheckResult):
        return got
    key, store, reg = got
    repo = VersionedRepo(store, reg.experiment, key, "models")
    try:
        value, m = repo.load_current()
    except (StoredObjectError, StorageError) as e:
        return dg.AssetCheckResult(passed=False, description=str(e))
    loss = (value.get("eval") or {}).get("loss")
    threshold = config.max_eval_loss
    if threshold is None:
        n = value.get("num_classes")
        threshold = math.log(n) if n and n > 1 else None
    if threshold is None:
        return dg.AssetCheckResult(passed=False, description="no max_eval_loss configured and "
                                   "the number of classes is unknown")
    ok = isinstance(loss, float) and math.isfinite(loss) and loss <= threshold
    return dg.AssetCheckResult(passed=ok, metadata={
        "eval_loss": loss if isinstance(loss, float) and math.isfinite(loss)
        else dg.MetadataValue.text(str(loss)),
        "max_eval_loss": float(threshold), "model_uri": dg.MetadataValue.text(repo.uri(m.name)),
        "step": int(value.get("step") or 0)})


@dg.asset_check(asset=model_checkpoint, name=STATE_CHECK, partitions_def=training_runs,
                description="The training run's state and why: fails for a run stopped for "
                "good (a warning when stopped on request, an error when the failure policy "
                "stopped it), so that it reads apart from a run never launched. Also recorded "
                "by the resume sensors and by a stop when they end a run.")
def training_run_state(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
    try:
        key = validate_partition_key(context.partition_key)
    except Exception as e:  # not a partitioned run, or a bad key
        return dg.AssetCheckResult(passed=False, description=f"no usable partition key: {e}")
    return state_check_result(run_state(context.instance, key))


TRAINING_CHECKS = [latest_checkpoint_verifies, latest_checkpoint_loss_is_finite,
                   final_model_meets_eval_loss_threshold, training_run_state]
