"""A loop over `ckpt.epochs()` that takes its batches from a `ResumableLoader`, run as a real
process by tests/standalone/test_loader_walk.py: combined by `zip(ckpt.batches(), loader)`
or by `ckpt.batches(loader)`. Each step prints the samples it trained on."""

import argparse
import os
import signal

import torch

from trainer import CheckpointSession, ResumableLoader

EPOCHS, SAMPLES, BATCH = 3, 64, 8

p = argparse.ArgumentParser()
p.add_argument("--store", required=True)
p.add_argument("--form", choices=("zip", "batches"), required=True)
p.add_argument("--sigterm-at", type=int, default=None, help="SIGTERM itself after this step")
args = p.parse_args()
torch.set_num_threads(1)

ckpt = CheckpointSession(run="walk", experiment="e", store=args.store, every_steps=5, seed=0)
data = torch.arange(SAMPLES, dtype=torch.float32).unsqueeze(1)
loader = ResumableLoader(data, BATCH, seed=1)
model = torch.nn.Linear(1, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
ckpt.restore(model=model, optimizer=opt, data=loader)
for epoch in ckpt.epochs(EPOCHS, len(loader)):
    if args.form == "zip":
        batches = (batch for _, batch in zip(ckpt.batches(), loader, strict=False))
    else:
        batches = ckpt.batches(loader)
    for batch in batches:
        loss = model(batch).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step = ckpt.loop.step + 1
        print(f"step {step} epoch {epoch} samples {batch.flatten().int().tolist()}", flush=True)
        ckpt.step(step, loss=loss)  # after a SIGTERM: commits this step and exits 143
        if step == args.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)
