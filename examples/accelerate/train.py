"""An Accelerate script: the loop is yours, `accelerator.prepare` places the objects.
An MLP with dropout on a noisy sine, AdamW, a step schedule, a step budget. `original.py`
is the script as its users write it; `train.py` the same, crash-safe (README.md).
"""

import argparse

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from ckpt_trainer import CheckpointSession, ResumableLoader
from torch import nn

p = argparse.ArgumentParser(description="an MLP under Accelerate")
p.add_argument("--steps", type=int, default=90)
p.add_argument("--store", default=None, help="checkpoint store (path, file:// or s3:// URI)")
p.add_argument("--log-level", default="INFO")
args = p.parse_args()
torch.set_num_threads(1)
set_seed(0)

accelerator = Accelerator(cpu=True)
x = torch.linspace(-3, 3, 640).unsqueeze(1)
data = torch.utils.data.TensorDataset(x, torch.sin(2 * x) + 0.2 * torch.randn_like(x))
loader = ResumableLoader(data, batch_size=32, seed=0)  # prepare() leaves it as it is
model = nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.5)
model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)

ckpt = CheckpointSession(run="sine", experiment="accelerate", store=args.store, max_steps=args.steps, every_steps=25)
step = ckpt.restore(model=accelerator.unwrap_model(model), optimizer=opt, scheduler=sched, data=loader)
while step < args.steps:
    for x_batch, y_batch in loader:
        loss = nn.functional.mse_loss(model(x_batch), y_batch)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
        if step % 30 == 0:
            accelerator.print(f"step {step}: loss {loss.item():.4f}")
        if ckpt.step(step, loss=loss) or step == args.steps:
            break
