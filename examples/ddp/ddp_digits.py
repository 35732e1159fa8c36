"""The digits CNN on several ranks with DistributedDataParallel, crash-safe as one job.

Every rank runs this script and calls the same `CheckpointSession`; the session keeps the
ranks one attempt: rank 0 finds and claims the checkpoint, every rank saves its share and
its own RNG states, a SIGTERM to any rank stops all of them at one committed step, and a
rank that dies fails the attempt once. The lines marked `# ckpt` are all it takes.

    python -m trainer.ranks --nproc-per-node 2 -- \\
        python examples/ddp/ddp_digits.py --store /tmp/ckpts --run ddp-1 --steps 120

(`torchrun --nproc-per-node 2 examples/ddp/ddp_digits.py ...` works too; `trainer.ranks` exits
with the cause when a rank fails, where torchrun exits 1 whatever happened.) Under Dagster,
register it with `distributed: {nproc_per_node: 2}` and `command: [python,
examples/ddp/ddp_digits.py, ...]`. The batch is global: each rank trains on its slice of it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "digits"))
from train import Net, digits, evaluate  # noqa: E402  (the single-rank example's model and data)

from ckpt_trainer import CheckpointSession, ResumableLoader  # noqa: E402  # ckpt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", default="checkpoints")
    p.add_argument("--run", default="ddp")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=64, help="global, over all ranks")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # seed: Python, NumPy and torch, the same on every rank (the same initial model).
    ckpt = CheckpointSession(run=args.run, experiment="digits", store=args.store, seed=0,  # ckpt
                             max_steps=args.steps, every_steps=20)  # ckpt
    train_set, test_set = digits()
    model = Net()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = ResumableLoader(train_set, args.batch_size, seed=0, rank=rank, world=world)

    start = ckpt.restore(model=model, optimizer=opt, data=loader)  # ckpt
    batches = loader.batches()
    for step in range(start + 1, args.steps + 1):
        x, y = next(batches)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        # The loss of the whole global batch, the same on every rank.
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        metrics = evaluate(model, test_set) if step % 40 == 0 else None
        ckpt.step(step, loss=mean / world, metrics=metrics)  # ckpt


if __name__ == "__main__":
    main()
