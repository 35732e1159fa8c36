"""The trainer's own loop (task mode), written on the public `CheckpointSession` API.

Resume in one sitting: build the task and every stateful part exactly as a fresh run
would, hand them to `session.restore` (which finds, verifies and loads the checkpoint and
claims the run), and continue from the step it returns. There is no second resume path:
a user's own loop does exactly the same.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
from collections.abc import Iterator
from typing import Any

import torch

from . import ddp
from .api.data import ResumableLoader
from .api.session import CheckpointSession, seed_all
from .api.task import (
    Task,
    build_task,
    needs_closure,
    resolve_task,
    task_optimizer,
    task_scheduler,
)
from .base.errors import ConfigError
from .config import OptimConfig, TrainConfig
from .device import autocast, grad_scaler, resolve_device
from .progress import Progress


def lr_schedule(optim: OptimConfig, max_steps: int):
    warm, floor = optim.warmup_steps, optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, max_steps - warm)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


# What torch raises when it refuses a value: from a config value, bad input.
_REFUSALS = (ValueError, TypeError, OverflowError, RuntimeError)


def _refused(key: str, e: BaseException) -> ConfigError:
    return ConfigError(f"config key {key!r} was refused by torch: {e}; fix it in the config")


@contextlib.contextmanager
def config_value(key: str):
    """What torch raises while it takes a config value is bad input naming the key: the
    config's ranges are meant to catch it first, and retrying cannot help."""
    try:
        yield
    except _REFUSALS as e:
        raise _refused(key, e) from None


def seed_everything(cfg: TrainConfig) -> None:
    """Every generator a task might draw from starts from the seed, so that a fresh run is
    reproducible and a resumed one can be compared with it."""
    with config_value("threads"):
        torch.set_num_threads(cfg.threads)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it
    with config_value("deterministic"):
        torch.use_deterministic_algorithms(cfg.deterministic)
    with config_value("seed"):
        seed_all(cfg.seed)


# torch.optim's messages for the arguments the default optimizer takes from `optim`.
_OPTIM_WORDS = (("learning rate", "optim.lr"), ("beta", "optim.betas"),
                ("weight_decay", "optim.weight_decay"))


def default_optimizer(o: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW from `optim`; a value torch refuses is bad input naming its key."""
    try:
        return torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas),
                                 weight_decay=o.weight_decay)
    except _REFUSALS as e:
        key = next((k for word, k in _OPTIM_WORDS if word in str(e)), "optim")
        raise _refused(key, e) from None


def optimizer_and_scheduler(cfg: TrainConfig, task: Task):
    """The task's own, or AdamW with warm-up and cosine decay from `cfg.optim`."""
    if cfg.distributed.strategy == "fsdp" and isinstance(task.optimizer, torch.optim.Optimizer):
        raise ConfigError(f"task {cfg.task!r} built its optimizer before the model was "
                          "sharded (distributed.strategy: fsdp replaces the parameters): "
                          "return a function of the model instead (optimizer=lambda m: ...)")
    optimizer = task_optimizer(cfg.task, task)
    if optimizer is None:
        optimizer = default_optimizer(cfg.optim, task.model)
        factor = lr_schedule(cfg.optim, cfg.max_steps)
    else:
        factor = _constant
    scheduler = task_scheduler(cfg.task, task, optimizer)
    if scheduler is None:
        with config_value("optim"):  # warm-up and decay come from `optim`
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return optimizer, scheduler


def _constant(step: int) -> float:
    return 1.0


def to_device(batch: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def evaluate(task: Task, model: torch.nn.Module) -> dict[str, float]:
    """The task's metrics, always under eval mode and without gradients."""
    model.eval()
    try:
        with torch.no_grad():
            return {k: float(v) for k, v in task.eval_fn(model).items()}
    finally:
        model.train()


def train_step(cfg: TrainConfig, task: Task, batches: Iterator[Any], optimizer, scaler,
               device: torch.device, model: torch.nn.Module | None = None) -> torch.Tensor:
    """One optimizer step over `grad_accum_steps` batches; returns the mean loss. `model`:
    what runs forward, when not the task's own module (its DDP wrapper)."""
    model, accum = model or task.model, cfg.grad_accum_steps
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for _ in range(accum):
        batch = to_device(next(batches), device)
        with autocast(device, cfg.amp.dtype):
            loss = task.loss_fn(model, batch)
        scaler.scale(loss / accum if accum > 1 else loss).backward()
        total += loss.detach().float()
    if cfg.optim.grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    scaler.step(optimizer)
    scaler.update()
    return total / accum if accum > 1 else total


def closure_step(cfg: TrainConfig, task: Task, batches: Iterator[Any], optimizer,
                 device: torch.device, model: torch.nn.Module | None = None) -> torch.Tensor:
    """One step of an optimizer that re-evaluates the loss itself (LBFGS): the closure runs
    forward and backward over this step's batches, as often as the optimizer asks; the loss
    reported is its first evaluation, taken before the parameters moved."""
    model, accum = model or task.model, cfg.grad_accum_steps
    model.train()
    micro = [to_device(next(batches), device) for _ in range(accum)]

    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float32, device=device)
        for batch in micro:
            with autocast(device, cfg.amp.dtype):
                loss = task.loss_fn(model, batch)
            (loss / accum if accum > 1 else loss).backward()
            total += loss.detach().float()
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        return total / accum if accum > 1 else total

    return optimizer.step(closure)


def check_closure_fits(cfg: TrainConfig, optimizer, scaler) -> bool:
    """Does the optimizer need a closure? A float16 GradScaler cannot drive one: refused
    before the run starts."""
    closure = needs_closure(optimizer)
    if closure and scaler.is_enabled():
        raise ConfigError(
            f"task {cfg.task!r}: {type(optimizer).__name__}.step needs a closure, and "
            "amp.dtype float16's GradScaler cannot drive one; set amp.dtype to bfloat16 or "
            "null, or train it in your own loop with trainer.CheckpointSession")
    return closure


def train(cfg: TrainConfig, store_uri: str | None = None, resume: str | None = None) -> int:
    """Run (or continue) training; return the exit code (0 done, 143 stopped, else failed)."""
    seed_everything(cfg)
    session = CheckpointSession(
        run=cfg.run, experiment=cfg.experiment, store=store_uri, resume=resume,
        max_steps=cfg.max_steps, config=cfg.to_dict(), dataset=cfg.dataset,
        **cfg.checkpoint.model_dump())
    try:
        with session:
            _run(cfg, session)
    except SystemExit as e:
        return int(e.code)
    return 0


def _run(cfg: TrainConfig, session: CheckpointSession) -> None:
    session.code_path = getattr(inspect.getmodule(resolve_task(cfg.task)), "__file__", None)
    rank, world, device = ddp.join(cfg, resolve_device(cfg.device))
    # Versioned before the task opens it: a dataset that cannot be read safely (a FIFO, a
    # device, a link out of it) is refused before any code of the task reads from it.
    data_version = session.data_version
    task = build_task(cfg.task, cfg.task_args, cfg.seed, session.dataset)
    if data_version is None:
        session.data_version = task.data_version
    task.model.to(device)
    net = ddp.wrap(task.model, device, world, cfg.distributed.strategy)
    optimizer, scheduler = optimizer_and_scheduler(cfg, task)
    scaler = grad_scaler(device, cfg.amp.dtype)
    closure = check_closure_fits(cfg, optimizer, scaler)
    try:
        loader = ResumableLoader(task.train_data, cfg.batch_size, seed=cfg.seed,
                                 shuffle=cfg.data.shuffle, num_workers=cfg.data.num_workers,
                                 collate_fn=task.collate, pin_memory=device.type == "cuda",
                                 rank=rank, world=world)
    except ValueError as e:
        raise ConfigError(f"config key 'batch_size': {e}") from None
    start = session.restore(model=task.model, optimizer=optimizer, scheduler=scheduler,
                            scaler=scaler, data=loader, task_values=task.values, **task.stateful)
    batches = loader.batches()
    progress = Progress(cfg.max_steps, start)
    for step in range(start + 1, cfg.max_steps + 1):
        if task.before_step:
            task.before_step(step)
        if closure:
            loss = closure_step(cfg, task, batches, optimizer, device, net)
        else:
            loss = train_step(cfg, task, batches, optimizer, scaler, device, net)
        loss = ddp.mean_over_ranks(loss, world).item()
        scheduler.step()
        metrics = None
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps):
            metrics = evaluate(task, task.model)
        if rank == 0:  # one progress line for the attempt
            progress.update(step, loss, scheduler.get_last_lr()[0])
        if session.step(step, loss=loss, metrics=metrics, epoch_end=loader.epoch_finished):
            return
