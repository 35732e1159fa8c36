"""Train a small CNN on scikit-learn's 8x8 digits, crash-safe and auto-resuming.

An ordinary PyTorch training script (argparse, TensorDataset, SGD with momentum, StepLR,
bf16 autocast on CPU, evaluation under no_grad); the lines marked `# ckpt` are all it takes
to make it resume exactly where it stopped, after a SIGKILL, a SIGTERM or a preemption.

    python examples/digits/train.py --store /tmp/ckpts --run digits-1 --steps 120
"""

from __future__ import annotations

import argparse
import logging
import os
import random

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

from ckpt_trainer import CheckpointSession, ResumableLoader  # ckpt

log = logging.getLogger("digits")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # 16 x 4 x 4
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # 32 x 2 x 2
        x = self.dropout(torch.flatten(x, 1))
        return self.fc2(F.relu(self.fc1(x)))


def digits(test_size: int = 297):
    d = load_digits()  # bundled with scikit-learn: 1797 images of 8x8 pixels, 0..16
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    x = (x - 0.3) / 0.4  # roughly zero mean, unit variance
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:test_size], order[test_size:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorDataset) -> dict[str, float]:
    model.eval()
    x, y = data.tensors
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x).float()
    model.train()
    return {"loss": F.cross_entropy(logits, y).item(),
            "accuracy": (logits.argmax(1) == y).float().mean().item()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--lr-step-epochs", type=int, default=2, help="StepLR: halve the LR every N epochs")
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=25, help="commit a checkpoint every N steps")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--store", default=None, help="checkpoint store: a path, file:// or s3:// URI")
    p.add_argument("--run", default="digits", help="run name (checkpoints of one run resume each other)")
    p.add_argument("--resume-from", default=None,
                   help="checkpoint URI to resume from (default: the run's newest valid one)")
    p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    args = p.parse_args()
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    random.seed(args.seed)  # every generator is saved in a checkpoint, so seed them all
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    train_data, test_data = digits()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.lr_step_epochs, gamma=0.5)
    # A DataLoader (with worker processes) that resumes at the exact next batch.
    loader = ResumableLoader(train_data, args.batch_size, seed=args.seed,  # ckpt
                             num_workers=args.workers)

    with CheckpointSession(run=args.run, experiment="digits", store=args.store,  # ckpt
                           resume=args.resume_from, max_steps=args.steps,  # ckpt
                           every_steps=args.ckpt_every, config=vars(args)) as ckpt:  # ckpt
        start = ckpt.restore(model=model, optimizer=optimizer, scheduler=scheduler,  # ckpt
                             data=loader)  # ckpt
        batches = loader.batches()
        model.train()
        for step in range(start + 1, args.steps + 1):
            x, y = next(batches)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            if loader.epoch_finished:
                scheduler.step()  # StepLR counts epochs
            metrics = None
            if step % args.eval_every == 0 or step == args.steps:
                metrics = evaluate(model, test_data)
                log.info("step %d  loss %.4f  test %s  lr %.4f", step, loss.item(),
                             {k: round(v, 4) for k, v in metrics.items()},
                             scheduler.get_last_lr()[0])
            if ckpt.step(step, loss=loss.item(), metrics=metrics,  # ckpt
                         epoch_end=loader.epoch_finished):  # ckpt
                break  # SIGTERM/SIGINT: this step is committed; exits 143


if __name__ == "__main__":
    main()
