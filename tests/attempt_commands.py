"""Commands as users write them, for the tests of an attempt's processes and for the soak.

    python tests/attempt_commands.py print-every-step --steps 300 --delay 0.05
        A loop on the own-loop API (trainer.CheckpointSession) that prints a line every
        step, each step slowed down by --delay seconds.

    python tests/attempt_commands.py fork-and-exit --pointer LATEST_JSON --pids FILE -- CMD...
        A launcher that forks and exits 0: its child starts CMD (and waits for it), while
        the launcher waits until LATEST_JSON names a checkpoint it did not name before (CMD
        has committed), writes the three pids (launcher, child, CMD) to FILE and exits 0.
        CMD trains on: its parent, the child, is alive, so nothing tells it to stop.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def print_every_step(steps: int, delay: float, every: int) -> None:
    import torch
    from torch import nn

    from trainer import CheckpointSession

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    with CheckpointSession(run="print-every-step", max_steps=steps, every_steps=every,
                           seed=0) as ckpt:
        start = ckpt.restore(model=model, optimizer=opt)
        for step in range(start + 1, steps + 1):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(delay)
            print(f"step {step} loss {loss.item():.5f}", flush=True)
            if ckpt.step(step, loss=loss):
                break


def _named(pointer: str) -> str | None:
    try:
        with open(pointer) as f:
            return json.load(f).get("checkpoint")
    except (OSError, ValueError):
        return None


def fork_and_exit(pointer: str, pids_file: str, argv: list[str], timeout: float) -> None:
    before = _named(pointer)
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # the child: starts the command and stays its parent
        os.close(r)
        cmd = os.fork()
        if cmd == 0:
            os.close(w)
            os.execvp(argv[0], argv)
        os.write(w, str(cmd).encode())
        os.close(w)
        _, status = os.waitpid(cmd, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    os.close(w)
    with os.fdopen(r) as f:
        cmd_pid = int(f.read())
    deadline = time.monotonic() + timeout
    while _named(pointer) in (None, before) and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(pids_file, "w") as f:
        json.dump({"launcher": os.getpid(), "child": child, "command": cmd_pid}, f)
    print(f"launcher exits 0; the command (pid {cmd_pid}) trains on", flush=True)
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    pr = sub.add_parser("print-every-step")
    pr.add_argument("--steps", type=int, default=300)
    pr.add_argument("--delay", type=float, default=0.05)
    pr.add_argument("--every", type=int, default=10)
    fk = sub.add_parser("fork-and-exit")
    fk.add_argument("--pointer", required=True)
    fk.add_argument("--pids", required=True)
    fk.add_argument("--timeout", type=float, default=300)
    fk.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args()
    if args.mode == "print-every-step":
        print_every_step(args.steps, args.delay, args.every)
    else:
        argv = args.command[1:] if args.command[:1] == ["--"] else args.command
        fork_and_exit(args.pointer, args.pids, argv, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
