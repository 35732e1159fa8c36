"""Task mode on several ranks: the process group, the DDP model, the loss of all ranks.

Under `python -m trainer.ranks` (torchrun's variables set, `distributed.nproc_per_node`
above 1) each rank joins the process group before the session restores, trains the task's
model wrapped in DistributedDataParallel on its slice of each global batch, and reports the
mean loss over the ranks, so the loss curve is the global batch's at any world size. The
checkpoint holds the task's own module (not the wrapper), so it loads at any world size.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.config import TrainConfig
from trainer.ranks import LOCAL_RANK_ENV, env_rank


def join(cfg: TrainConfig, device: torch.device) -> tuple[int, int, torch.device]:
    """Join the ranks when torchrun started this process as one of several: (rank, world
    size, this rank's device); (0, 1, device) alone."""
    rank, world = env_rank()
    if world == 1:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get(LOCAL_RANK_ENV, 0)))
        torch.cuda.set_device(device)
    backend = cfg.distributed.backend
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(
            seconds=cfg.checkpoint.collective_timeout_s))
    return rank, world, device


def wrap(model: torch.nn.Module, device: torch.device, world: int) -> torch.nn.Module:
    """The module the loop trains: DDP over the task's model with several ranks."""
    if world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def mean_over_ranks(loss: torch.Tensor, world: int) -> torch.Tensor:
    if world == 1:
        return loss
    loss = loss.detach().clone()
    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
    return loss / world
