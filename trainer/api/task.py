"""The task interface: what a user's training code gives the trainer.

A task is built by a function named in the config as `package.module:function`. It
receives the task's own arguments (`task_args`), the run's seed and the dataset's URI, and
returns a `Task`. The task owns the model, the data and the loss, and may bring its own
optimizer and LR scheduler (default: AdamW with warm-up and cosine decay from `optim`).
The trainer owns the loop: device, AMP, gradient accumulation, clipping, the DataLoader,
evaluation (always under `model.eval()` and `torch.no_grad()`), checkpoints and resume.
An optimizer whose `step` needs a closure (LBFGS and friends) gets one: it re-evaluates the
loss of the step's batches (so `loss_fn` runs once per evaluation).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import default_collate

from ..base.errors import ConfigError

Optimizer = torch.optim.Optimizer
Scheduler = torch.optim.lr_scheduler.LRScheduler


@dataclass
class Task:
    model: torch.nn.Module
    # A map-style dataset (len and [i]); batches come from a DataLoader over it.
    train_data: Sequence[Any]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    eval_fn: Callable[[torch.nn.Module], dict[str, float]]
    collate: Callable[[list[Any]], Any] = default_collate
    # An optimizer, or a function of the model (called after the model is on its device).
    optimizer: Optimizer | Callable[[torch.nn.Module], Optimizer] | None = None
    # A scheduler, or a function of the optimizer; with the task's own optimizer and no
    # scheduler the learning rate stays constant.
    scheduler: Scheduler | Callable[[Optimizer], Scheduler] | None = None
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
    dataset: str | None = None  # the config's dataset URI (None: the task makes its data)


def resolve_task(spec: str) -> Callable[[TaskArgs], Task]:
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, TypeError, ValueError) as e:  # (the last two: a relative or empty name)
        raise ConfigError(
            f"task {spec!r}: cannot import module {module_name!r} ({e}); check the config's "
            "'task' and that the package is installed or on PYTHONPATH"
        ) from e
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ConfigError(f"task {spec!r}: module {module_name!r} has no function {func_name!r}")
    if not inspect.isfunction(fn):
        # A builtin (os:system) or a class would be called with TaskArgs: never what was meant.
        raise ConfigError(f"task {spec!r} is a {type(fn).__name__}, not a Python function "
                          "that takes TaskArgs and returns trainer.api.task.Task")
    return fn


def build_task(spec: str, args: dict[str, Any], seed: int, dataset: str | None = None) -> Task:
    task = resolve_task(spec)(TaskArgs(dict(args), seed, dataset))
    if not isinstance(task, Task):
        raise ConfigError(f"task {spec!r} returned {type(task).__name__}, not trainer.api.task.Task")
    if not isinstance(task.model, torch.nn.Module):
        raise ConfigError(f"task {spec!r}: model is a {type(task.model).__name__}, not a "
                          "torch.nn.Module")
    if not hasattr(task.train_data, "__len__") or not hasattr(task.train_data, "__getitem__"):
        raise ConfigError(f"task {spec!r}: train_data is a {type(task.train_data).__name__}; "
                          "it must be a map-style dataset (len() and [i]), e.g. a list or a "
                          "torch.utils.data.Dataset")
    return task


def _built(spec: str, what: str, value: Any, arg: Any, want: type, hint: str) -> Any:
    obj = value(arg) if callable(value) and not isinstance(value, want) else value
    if not isinstance(obj, want):
        raise ConfigError(f"task {spec!r}: {what} is a {type(obj).__name__}, not a "
                          f"{want.__module__}.{want.__qualname__}; {hint}")
    return obj


def task_optimizer(spec: str, task: Task) -> Optimizer | None:
    """The task's own optimizer (None: use the default); a wrong type is bad input."""
    if task.optimizer is None:
        return None
    return _built(spec, "optimizer", task.optimizer, task.model, Optimizer,
                  "return a torch.optim optimizer or a function of the model that builds one")


def needs_closure(optimizer: Optimizer) -> bool:
    """Does `optimizer.step` require a closure (LBFGS and friends)?"""
    try:
        param = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a builtin or C-implemented step: no closure
        return False
    return param is not None and param.default is inspect.Parameter.empty


def task_scheduler(spec: str, task: Task, optimizer: Optimizer) -> Scheduler | None:
    if task.scheduler is None:
        return None
    sched = _built(spec, "scheduler", task.scheduler, optimizer, Scheduler,
                   "return a torch.optim.lr_scheduler scheduler or a function of the optimizer")
    if sched.optimizer is not optimizer:
        raise ConfigError(f"task {spec!r}: the scheduler drives another optimizer than the "
                          "task's; build it on the same optimizer")
    return sched
