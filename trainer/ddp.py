"""Task mode on several ranks: the process group, the DDP or FSDP2 model, the loss of all
ranks.

Under `python -m trainer.ranks` (torchrun's variables set, `distributed.nproc_per_node`
above 1) each rank joins the process group before the session restores, trains the task's
model on its slice of each global batch, and reports the mean loss over the ranks, so the
loss curve is the global batch's at any world size. With `strategy: ddp` the model is
wrapped in DistributedDataParallel and the checkpoint holds the task's own module (not the
wrapper); with `strategy: fsdp` it is sharded in place by `fully_shard`, and the session
saves its shards (and the optimizer's) through DCP (`trainer.ranks.sharded`). Either loads at
any world size.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import TrainConfig
from .ranks.world import LOCAL_RANK_ENV, env_rank


def join(cfg: TrainConfig, device: torch.device) -> tuple[int, int, torch.device]:
    """Join the ranks when torchrun started this process as one of several: (rank, world
    size, this rank's device); (0, 1, device) alone."""
    rank, world = env_rank()
    sharded = cfg.distributed.strategy == "fsdp"
    if world == 1 and not sharded:
        return 0, 1, device
    if device.type == "cuda":
        if world > 1:  # a rank per device; one rank keeps the device its config names
            device = torch.device("cuda", int(os.environ.get(LOCAL_RANK_ENV, 0)))
        if device.index is not None:
            torch.cuda.set_device(device)
    backend = cfg.distributed.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        # FSDP shards over a group of one rank too, where no torchrun set up a meeting point.
        alone = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if world == 1 else {}
        dist.init_process_group(backend, timeout=timedelta(
            seconds=cfg.checkpoint.collective_timeout_s), **alone)
    return rank, world, device


def wrap(model: torch.nn.Module, device: torch.device, world: int,
         strategy: str = "ddp") -> torch.nn.Module:
    """The module the loop trains: the task's model sharded (fsdp), or DDP over it with
    several ranks."""
    if strategy == "fsdp":
        return shard(model)
    if world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 over `model`, in place: each submodule that holds parameters of its own is a
    unit (its parameters gathered only while it runs), then the model itself."""
    from torch.distributed.fsdp import fully_shard

    for m in list(model.modules()):
        if m is not model and next(m.parameters(recurse=False), None) is not None:
            fully_shard(m)
    fully_shard(model)
    return model


def mean_over_ranks(loss: torch.Tensor, world: int) -> torch.Tensor:
    if world == 1:
        return loss
    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
    return loss / world
