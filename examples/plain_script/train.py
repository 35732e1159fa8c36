"""A plain training script (noisy polynomial regression) that checkpoints through
`trainer.CheckpointSession` and nothing else: no trainer loop, no special DataLoader.

Minibatches are drawn with torch's global RNG, which the session saves and restores with
the model and optimizer, so a resumed run draws exactly the batches an uninterrupted one
would have. Standalone:

    python examples/plain_script/train.py --store /tmp/ckpts --steps 150

Under the orchestrator (config `command: [python, examples/plain_script/train.py]`) the
newest verified checkpoint, the run, the store and the attempt arrive in the environment
($CKPT_RESUME_FROM, ...), which the session reads; `--resume-from` serves standalone runs.
"""

import argparse
import logging
import os
import random

import numpy as np
import torch
from torch import nn

from ckpt_trainer import CheckpointSession

p = argparse.ArgumentParser(description="noisy polynomial regression, resumable")
p.add_argument("--steps", type=int, default=150)
p.add_argument("--lr", type=float, default=0.01)
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--store", default=None, help="checkpoint store (path, file:// or s3:// URI)")
p.add_argument("--run", default="plain")
p.add_argument("--resume-from", default=None, help="checkpoint URI (default: newest valid)")
p.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
args = p.parse_args()
logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
torch.set_num_threads(1)
random.seed(0)  # the session saves every generator's state: seed them all
np.random.seed(0)
torch.manual_seed(0)

x = torch.linspace(-2, 2, 2048).unsqueeze(1)
y = x**3 - 2 * x + 0.3 * torch.randn_like(x)
model = nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=args.lr)
stats = {"ema": 0.0}  # plain values are checkpointed too

with CheckpointSession(run=args.run, experiment="plain", store=args.store,
                       resume=args.resume_from, max_steps=args.steps, every_steps=20) as ckpt:
    start = ckpt.restore(model=model, optimizer=opt, stats=stats)
    for step in range(start + 1, args.steps + 1):
        idx = torch.randint(0, len(x), (args.batch_size,))
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        stats["ema"] = 0.9 * stats["ema"] + 0.1 * loss.item()
        if step % 50 == 0:
            print(f"step {step}: loss {loss.item():.4f} (ema {stats['ema']:.4f})", flush=True)
        if ckpt.step(step, loss=loss):
            break  # SIGTERM: this step is committed; the session exits 143
