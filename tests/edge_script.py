"""A user's script at the edges of a workflow, run as a real process by
tests/standalone/test_workflow_edges.py: it may seed nothing, stop itself with a real SIGTERM, loop
without end until its loss is low, or train no step at all."""

import argparse
import os
import signal

import torch

from trainer import CheckpointSession

p = argparse.ArgumentParser()
p.add_argument("--store", required=True)
p.add_argument("--seed", type=int, default=None, help="the session's seed= (default: none)")
p.add_argument("--sigterm-at", type=int, default=None, help="SIGTERM itself after this step")
p.add_argument("--until", type=int, default=30, help="open-ended loop: leave at this step")
p.add_argument("--no-steps", action="store_true", help="the loop never runs")
p.add_argument("--continue-finished", action="store_true")
p.add_argument("--seed-torch", action="store_true", help="seed torch alone, first thing")
p.add_argument("--numpy-split", action="store_true",
               help="draw from NumPy's unseeded generator before restore (a split, say)")
p.add_argument("--unsavable", action="store_true",
               help="a dict part holding a file handle, which cannot be pickled")
p.add_argument("--kill-after-loop", action="store_true",
               help="SIGKILL itself after the loop, before the post-loop work")
p.add_argument("--max-steps", type=int, default=None)
p.add_argument("--calls-per-batch", type=int, default=1,
               help="ckpt.step() calls per batch, counting for themselves (more than one: a bug)")
args = p.parse_args()
torch.set_num_threads(1)
if args.seed_torch:
    torch.manual_seed(0)

ckpt = CheckpointSession(run="edge", experiment="e", store=args.store, every_steps=5,
                         seed=args.seed, continue_finished=args.continue_finished,
                         max_steps=args.max_steps)
x = torch.randn(64, 3)  # drawn before restore: other data in every unseeded process
y = x.sum(1, keepdim=True)
if args.numpy_split:
    import numpy as np

    x, y = x[np.random.permutation(64)], y  # drawn before restore, from an unseeded NumPy
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
phase = "training"  # kept: the post-loop work sets it
ckpt.keep(globals(), "phase")
parts = {"stats": {"loss": 0.0, "log": open(os.devnull, "w")}} if args.unsavable else {}
step = ckpt.restore(model=model, optimizer=opt, **parts)
while not args.no_steps:  # open-ended: no max_steps, the loop decides when it is done
    step += 1
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if args.calls_per_batch == 1:
        ckpt.step(step, loss=loss)
    else:  # the bug: each call counts a step of its own
        for _ in range(args.calls_per_batch):
            ckpt.step(loss=loss)
    if step == args.sigterm_at:
        os.kill(os.getpid(), signal.SIGTERM)  # the next step() commits and exits 143
    if step % args.until == 0:
        break
print(f"left the loop at step {step}", flush=True)
if args.kill_after_loop:
    os.kill(os.getpid(), signal.SIGKILL)
phase = "evaluated"  # the post-loop work: a last evaluation, a test pass
print("post-loop work done", flush=True)
