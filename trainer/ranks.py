"""`python -m trainer.ranks`: start an attempt's ranks through torchrun, exit as one process.

    python -m trainer.ranks --nproc-per-node 2 [--nnodes 2 --rdzv-endpoint HOST:PORT
        --rdzv-id RUN] [--grace-seconds 60] -- COMMAND [ARGS...]

runs COMMAND once per rank with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), its own restarts off: the orchestrator owns resumes, so one
rank's death fails the whole attempt once. torchrun exits 1 for any failed rank, which
would read as a bug; this launcher exits with the attempt's cause instead
(`attempt_exit`), in the vocabulary of `trainer.outcomes`:

* a rank killed by a signal other than a stop (SIGKILL, the OOM killer): 128 + the signal;
* else the first rank whose own failure is not the echo of another's (a bug, bad input,
  divergence, a store that is gone, superseded);
* else a lost rank (7) if any rank saw one, else a preemption (143).

SIGTERM or SIGINT to this process is passed to every rank (torchrun does it); the ranks
agree on one step, commit it and exit 143; ranks still running after `--grace-seconds` are
killed. One node (`--nnodes 1`, the default) rendezvouses on a free local port; several
nodes run this same command on every node with the same `--rdzv-endpoint` (a host:port of
node 0 that all nodes reach) and `--rdzv-id`.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from trainer.outcomes import STOP_SIGNALS, Outcome, signal_of

# torchrun's variables, read by the session to know its rank without a process group.
RANK_ENV = "RANK"
WORLD_SIZE_ENV = "WORLD_SIZE"
LOCAL_RANK_ENV = "LOCAL_RANK"
# A rank's own failure that only reports another's: it lost a peer, or was told to stop.
ECHOES = (Outcome.RANK_LOST, Outcome.PREEMPTED)


def env_rank(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(rank, world size) as torchrun set them for this process; (0, 1) outside torchrun."""
    try:
        return int(environ.get(RANK_ENV, 0)), int(environ.get(WORLD_SIZE_ENV, 1))
    except ValueError:
        return 0, 1


# What gloo puts in the plain RuntimeError it raises when a peer goes away or a collective
# times out (torch's own DistError subclasses, NCCL's among them, are caught by type). Only
# these: a RuntimeError that merely names a backend can be a bug, which is never resumed.
PEER_LOST_WORDS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting")


def lost_a_peer(error: BaseException) -> bool:
    """Did a collective fail under this rank (a peer died or hung), in our code or the
    user's (DDP's backward)? Only ever asked of a process that is one of several ranks."""
    if any(c.__name__ == "DistError" for c in type(error).__mro__):
        return True
    return isinstance(error, RuntimeError) and any(w in str(error) for w in PEER_LOST_WORDS)


def attempt_exit(rank_codes: Mapping[int, int]) -> int:
    """The attempt's exit code from its failed ranks' exit statuses (rank -> Popen's code,
    -N for a signal): the cause, not the echoes (module docstring)."""
    ranks = sorted(rank_codes)
    for r in ranks:
        sig = signal_of(rank_codes[r])
        if rank_codes[r] < 0 and sig not in STOP_SIGNALS:
            return 128 + sig
    outcomes = {r: Outcome.of_exit(rank_codes[r]) for r in ranks}
    for r in ranks:
        if outcomes[r] not in ECHOES:
            code = rank_codes[r]
            return 128 + signal_of(code) if code < 0 else code
    if Outcome.RANK_LOST in outcomes.values():
        return Outcome.RANK_LOST.exit_code
    return Outcome.PREEMPTED.exit_code


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m trainer.ranks", description=__doc__.split("\n")[0])
    p.add_argument("--nproc-per-node", type=int, required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--rdzv-endpoint", default=None)
    p.add_argument("--rdzv-id", default=None)
    p.add_argument("--grace-seconds", type=int, default=60)
    if "--" not in argv:
        p.error("put the command after `--`: python -m trainer.ranks [...] -- COMMAND")
    cut = argv.index("--")
    args, command = p.parse_args(argv[:cut]), argv[cut + 1:]
    if not command:
        p.error("no command after `--`")
    if args.nproc_per_node < 1 or args.nnodes < 1:
        p.error("--nproc-per-node and --nnodes must be at least 1")
    from trainer.config import MAX_PARALLEL  # here: the launcher's help needs no pydantic

    if args.nproc_per_node > MAX_PARALLEL or args.nnodes > MAX_PARALLEL:
        p.error(f"--nproc-per-node and --nnodes must be at most {MAX_PARALLEL}, the bound of "
                "the config's distributed.nproc_per_node and nnodes (one process per rank)")
    if args.nnodes > 1 and not (args.rdzv_endpoint and args.rdzv_id):
        p.error("several nodes need --rdzv-endpoint HOST:PORT (node 0's, reachable from "
                "every node) and --rdzv-id (the same on every node, e.g. the run's name)")
    return args, command


def torchrun_args(args: argparse.Namespace, command: list[str]) -> list[str]:
    out = ["--nproc-per-node", str(args.nproc_per_node), "--nnodes", str(args.nnodes),
           "--max-restarts", "0", "--shutdown-timeout", str(args.grace_seconds)]
    if args.nnodes == 1:
        out.append("--standalone")
    else:
        out += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint,
                "--rdzv-id", args.rdzv_id]
    # `--` first: argparse would take a command argument like `--run` for an abbreviation of
    # one of torchrun's own options.
    return [*out, "--no-python", "--", *command]


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args, command = parse(sys.argv[1:] if argv is None else argv)
    try:
        torchrun.run(torchrun.parse_args(torchrun_args(args, command)))
    except ChildFailedError as e:
        return attempt_exit({rank: f.exitcode for rank, f in e.failures.items()})
    except SignalException as e:
        # Asked to stop: every rank was passed the signal and had the grace to commit.
        return 128 + int(e.sigval)
    return Outcome.SUCCESS.exit_code


if __name__ == "__main__":
    sys.exit(main())
