"""A user's own loop on several ranks whose save can be held inside the barrier.

    python tests/barrier_user.py STORE

Each rank joins the process group (torchrun's variables), trains a small model and calls
the session every step. At step $BLOCK_AT_STEP the part `gate` (written by rank 0) takes
its state only after touching $BLOCK_MARKER and sleeping: rank 1 has then written its file
and waits in the save's barrier, where the test kills a rank.

With $START_GATE set, a rank imports, then waits for that file to appear and reads the step
to block at from it: the test starts the next trial's ranks while this one runs, so that
the interpreters' start-up (torch's import) is not paid between trials.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainer import CheckpointSession

MAX_STEPS = int(os.environ.get("MAX_STEPS", "80"))
BLOCK_AT = int(os.environ.get("BLOCK_AT_STEP", "0"))


class Gate:
    def __init__(self, session: CheckpointSession):
        self.session = session

    def state_dict(self) -> dict:
        if self.session.loop.step == BLOCK_AT:
            Path(os.environ["BLOCK_MARKER"]).write_text(str(BLOCK_AT))
            time.sleep(600)
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def wait_for_gate() -> None:
    global BLOCK_AT
    gate = Path(os.environ["START_GATE"])
    while not gate.exists():
        time.sleep(0.01)
    BLOCK_AT = int(gate.read_text())


def main() -> None:
    if os.environ.get("START_GATE"):
        wait_for_gate()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ckpt = CheckpointSession(run="barrier", store=sys.argv[1], max_steps=MAX_STEPS,
                             every_steps=2, keep_last=2)
    start = ckpt.restore(model=model, optimizer=opt, gate=Gate(ckpt))
    for step in range(start + 1, MAX_STEPS + 1):
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step(step, loss=loss)


if __name__ == "__main__":
    main()
