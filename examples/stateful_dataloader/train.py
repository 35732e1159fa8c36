"""A training script fed by torchdata's StatefulDataLoader: shuffled batches from two
worker processes, an MLP with dropout, AdamW, a step budget. `original.py` is the script as
its users write it; `train.py` the same with the session's lines (README.md).
"""

import argparse
import logging

import torch
from ckpt_trainer import CheckpointSession
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

p = argparse.ArgumentParser(description="noisy sine regression fed by StatefulDataLoader")
p.add_argument("--steps", type=int, default=120)
p.add_argument("--store", default=None, help="checkpoint store (path, file:// or s3:// URI)")
p.add_argument("--log-level", default="INFO")
args = p.parse_args()
logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
torch.set_num_threads(1)
torch.manual_seed(0)


class Points(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.x = torch.linspace(-3, 3, n).unsqueeze(1)
        self.y = torch.sin(2 * self.x) + 0.2 * torch.randn_like(self.x)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


loader = StatefulDataLoader(Points(600), batch_size=32, shuffle=True, drop_last=True,
                            num_workers=2)
model = nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

ckpt = CheckpointSession(run="sdl", experiment="sdl", store=args.store, max_steps=args.steps, every_steps=25)
step = ckpt.restore(model=model, optimizer=opt, scheduler=sched, data=loader)
while step < args.steps:
    for x, y in loader:  # one epoch; the next `for` starts another
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        if step % 20 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
        if ckpt.step(step, loss=loss) or step == args.steps:
            break
