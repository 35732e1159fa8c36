"""Restore the FSDP2 example's newest checkpoint at this world size and write what every
rank's shards add up to (whole model and optimizer state, gathered to rank 0) to OUT:
tests/standalone/test_fsdp.py compares it with the checkpoint's own bytes to prove a resharded load
exact. Run under `python -m trainer.ranks --nproc-per-node N -- python THIS STORE RUN OUT`
on a copy of a store (restoring claims the run); the checkpoint must be a run's final one,
so that leaving the session commits nothing.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "fsdp"))
from fsdp_transformer import build  # noqa: E402

from trainer import CheckpointSession  # noqa: E402

store, run, out = sys.argv[1:4]
dist.init_process_group("gloo")
model, opt = build()
with CheckpointSession(run=run, experiment="fsdp", store=store,
                       continue_finished=True) as ckpt:  # it only inspects the state
    step = ckpt.restore(model=model, optimizer=opt)
    assert step > 0, "nothing was restored"
    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, opt, options=whole)
    if dist.get_rank() == 0:
        torch.save({"step": step, "model": model_state, "optimizer": optim_state}, out)
dist.destroy_process_group()
