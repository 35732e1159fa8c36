"""A two-rank own loop with no max_steps that destroys its process group after its loop, as
torchrun scripts do, run by tests/standalone/test_ranks_end.py under the ranks launcher:
without a block, the session's end (at exit) comes after the group is gone, unless the
script closes it first (`--close-first`)."""

import argparse

import torch
import torch.distributed as dist

from trainer import CheckpointSession

p = argparse.ArgumentParser()
p.add_argument("--store", required=True)
p.add_argument("--close-first", action="store_true", help="ckpt.close() before destroying")
args = p.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
ckpt = CheckpointSession(run="ends", experiment="e", store=args.store, every_steps=5)
x = torch.randn(16, 3)
y = x.sum(1, keepdim=True)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
start = ckpt.restore(model=model, optimizer=opt)
for step in range(start + 1, 13):  # open-ended in spirit: the loop, not max_steps, ends it
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    ckpt.step(step, loss=loss)
if args.close_first:
    ckpt.close()
dist.destroy_process_group()
print(f"rank {dist.get_rank() if dist.is_initialized() else '-'}: group destroyed", flush=True)
