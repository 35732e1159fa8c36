"""The final model: the last checkpoint's `model` weights, evaluated and exported.

Task mode rebuilds the task from the registered config, loads the weights and evaluates
them on the task's held-out data (under `model.eval()` and `torch.no_grad()`); command mode
has no task to rebuild, so the metrics are those the script recorded with its last
checkpoint.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path
from typing import Any

from ckpt_assets.base.datasets import describe_dataset
from ckpt_assets.base.end import checkpoint_unloadable
from ckpt_assets.base.registration import Registration
from ckpt_assets.mlflow.tracking import MlflowTracker
from trainer.base import strict_json
from trainer.base.errors import ConfigError
from trainer.checkpoints.records import CheckpointRecord


def evaluate_final(reg: Registration, weights: dict[str, Any], ck: CheckpointRecord,
                   log) -> tuple[dict[str, float], str | None]:
    """(metrics, data version) of the final weights."""
    cfg = reg.config
    recorded = {k: float(v) for k, v in ck.eval.items()}
    recorded_version = ck.lineage.data_version if ck.lineage else None
    if cfg.command:
        return recorded, recorded_version
    import torch

    from trainer.api.task import build_task
    from trainer.loop import evaluate

    torch.set_num_threads(cfg.threads)
    try:
        task = build_task(cfg.task, cfg.task_args, cfg.seed, cfg.dataset)
        task.model.load_state_dict(weights)
    except (ConfigError, RuntimeError, KeyError) as e:
        raise checkpoint_unloadable(
            f"cannot rebuild the model of {reg.run} from its registered config and checkpoint "
            f"{ck.uri}: {e}", reg.run, ck) from e
    data_version = recorded_version or task.data_version
    # Under Dagster a generated dataset is versioned by its generator (`training_dataset`),
    # standalone by the task's own hash of what it generated: either names the same data.
    same = {task.data_version, None if cfg.dataset else describe_dataset(reg)[0].version}
    if task.data_version and recorded_version not in same | {None}:
        log.warning(f"held-out data version {task.data_version} differs from the checkpoint's "
                    f"data version {recorded_version}")
    return evaluate(task, task.model), data_version


def export_weights(reg: Registration, weights: dict[str, Any], ck: CheckpointRecord,
                   metrics: dict[str, float], tracker: MlflowTracker):
    """(value, SHA-256 of the weights file, MLflow model version) of the exported model."""
    import torch

    weights = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    # The output width of the last 2-D layer: the number of classes of a classifier (used
    # as the default chance-level threshold of the eval-loss check).
    num_classes = next((int(v.shape[0]) for v in reversed(list(weights.values())) if v.dim() == 2),
                       None)
    with tempfile.TemporaryDirectory(prefix="ckpt-final-") as tmp:
        path = Path(tmp) / "model.pt"
        torch.save(weights, path)
        weights_sha = hashlib.sha256(path.read_bytes()).hexdigest()
        model_version = tracker.log_final_model(
            str(path), {f"eval_{k}": v for k, v in metrics.items()}, ck.step,
            description=f"{reg.experiment}/{reg.run} step {ck.step} from {ck.uri}")
    cfg = reg.config
    value = {"model": weights, "task": None if cfg.command else cfg.task,
             "command": cfg.command, "task_args": cfg.task_args, "seed": cfg.seed,
             "step": ck.step, "eval": metrics,
             "num_classes": num_classes, "checkpoint": ck.uri,
             "checkpoint_sha256": ck.sha256, "experiment": reg.experiment,
             "training_run": reg.run, "config": strict_json.dumps(cfg.to_dict(), sort_keys=True)}
    return value, weights_sha, model_version
