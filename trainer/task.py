"""The task interface: what a user's training code gives the trainer.

A task is built by a function named in the config as `package.module:function`. It
receives the task's own arguments (`task_args`) plus the run's seed and returns a `Task`.
The trainer owns the optimizer, schedule, clipping, checkpoints and resume; the task owns
the model, the data and the loss.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import default_collate

from trainer.errors import ConfigError


@dataclass
class Task:
    model: torch.nn.Module
    train_data: Sequence[Any]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    eval_fn: Callable[[torch.nn.Module], dict[str, float]]
    collate: Callable[[list[Any]], Any] = default_collate
    # Extra parts with state_dict()/load_state_dict(): saved and restored with the rest.
    stateful: dict[str, Any] = field(default_factory=dict)
    # Plain JSON-serializable values the task mutates; restored into this same dict.
    values: dict[str, Any] = field(default_factory=dict)
    # Content hash of the training data, recorded as the data version in lineage.
    data_version: str | None = None
    # Called with the step number before each step (after a resume too).
    before_step: Callable[[int], None] | None = None


@dataclass
class TaskArgs:
    args: dict[str, Any]
    seed: int


def resolve_task(spec: str) -> Callable[[TaskArgs], Task]:
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"task {spec!r}: cannot import module {module_name!r} ({e}); check the config's "
            "'task' and that the package is installed or on PYTHONPATH"
        ) from e
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ConfigError(f"task {spec!r}: module {module_name!r} has no function {func_name!r}")
    return fn


def build_task(spec: str, args: dict[str, Any], seed: int) -> Task:
    task = resolve_task(spec)(TaskArgs(dict(args), seed))
    if not isinstance(task, Task):
        raise ConfigError(f"task {spec!r} returned {type(task).__name__}, not trainer.task.Task")
    return task
