"""`python -m trainer.ranks`: start an attempt's ranks through torchrun, exit as one process.

    python -m trainer.ranks --nproc-per-node 2 [--nnodes 2] [--rdzv-endpoint HOST:PORT
        --rdzv-id RUN | --local-nodes] [--grace-seconds 60] [--heartbeat-timeout-s 30]
        -- COMMAND [ARGS...]

runs COMMAND once per rank with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), its own restarts off: the orchestrator owns resumes, so one
rank's death fails the whole attempt once. torchrun exits 1 for any failed rank, which
would read as a bug; this launcher exits with the attempt's cause instead
(`attempt_exit`), in the vocabulary of `trainer.base.outcomes`:

* a rank killed by a signal other than a stop (SIGKILL, the OOM killer): 128 + the signal;
* else the first rank whose own failure is not the echo of another's (a bug, bad input,
  divergence, a store that is gone, superseded);
* else a lost rank (7) if any rank saw one, else a preemption (143).

Every rank is watched (`trainer.ranks.rank_watch`): each rank's session beats a file of this
launcher's; a rank silent for `--heartbeat-timeout-s` (frozen: SIGSTOP, a debugger) is
killed and counts as lost (7), so the attempt ends within seconds of the timeout instead of
waiting out the collective timeout.

SIGTERM or SIGINT to this process is passed to every rank (torchrun does it); the ranks
agree on one step, commit it and exit 143; ranks still running after `--grace-seconds` are
killed. One node (`--nnodes 1`, the default) rendezvouses on a free local port, or on
`--rdzv-endpoint` when one is given; several nodes run this same command on every node
with the same `--rdzv-endpoint` (a host:port of node 0 that all nodes reach) and
`--rdzv-id`, or one launcher with `--local-nodes` starts every node on this machine
(`trainer.ranks.nodes`: how several nodes are tried without a second machine). What a run's
config refuses (`distributed`) is refused here too: exit 2, one line that says what to pass.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

from ..base.outcomes import Outcome
from ..config import MAX_COLLECTIVE_S, MAX_PARALLEL, rendezvous_problem
from ..process.contract import Env
from .rank_watch import RankWatch
from .world import attempt_exit

# A rank whose liveness beat is older than this is lost (`trainer.ranks.rank_watch`): long above
# its 1 s beat, far below the collective timeout (600 s) it would otherwise wait out.
HEARTBEAT_TIMEOUT_S = 30.0
# torchrun's own default rendezvous id, for one node on an endpoint of its own.
DEFAULT_RDZV_ID = "none"


def started_as() -> str:
    """The launcher under the name it was started by: `trainer.ranks`, or `ckpt_trainer.ranks`
    as the orchestrator starts it (trainer.process.contract.RANKS_LAUNCHER); the two names
    share this one module, so the name is read off the `__main__` that runs it."""
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    if main is not None and main.name.endswith(".ranks.__main__"):
        return main.parent
    return __package__ or "trainer.ranks"


MODULE = started_as()
PROG = f"python -m {MODULE}"


def refuse(message: str) -> NoReturn:
    """Bad input to the launcher: one line that says what to do, exit 2 (`bad_input`)."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)
    raise SystemExit(Outcome.BAD_INPUT.exit_code)


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        refuse(f"{message} (see: {PROG} --help)")


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = _OneLineParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--nproc-per-node", type=int, required=True)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--rdzv-endpoint", default=None)
    p.add_argument("--rdzv-id", default=None)
    p.add_argument("--grace-seconds", type=int, default=60)
    p.add_argument("--heartbeat-timeout-s", type=float, default=HEARTBEAT_TIMEOUT_S)
    p.add_argument("--local-nodes", action="store_true",
                   help="start every one of --nnodes on this machine (trainer.ranks.nodes)")
    if "--" not in argv:
        refuse(f"put the command after `--`: {PROG} [...] -- COMMAND")
    cut = argv.index("--")
    args, command = p.parse_args(argv[:cut]), argv[cut + 1:]
    if not command:
        refuse(f"no command after `--`: {PROG} [...] -- COMMAND")
    check(args)
    return args, command


def check(args: argparse.Namespace) -> None:
    """Refuse what the config's `distributed` section refuses, in its words."""
    for flag, value in (("--nproc-per-node", args.nproc_per_node), ("--nnodes", args.nnodes)):
        if not 1 <= value <= MAX_PARALLEL:
            refuse(f"{flag} {value} is out of range: pass 1 to {MAX_PARALLEL} "
                   "(distributed.nproc_per_node / distributed.nnodes of a run's config)")
    if args.rdzv_endpoint is not None and (problem := rendezvous_problem(args.rdzv_endpoint)):
        refuse(f"--rdzv-endpoint: {problem}")
    if args.local_nodes and args.rdzv_endpoint is not None:
        refuse("--local-nodes meet on a free loopback port of their own: drop "
               "--rdzv-endpoint, or drop --local-nodes and start each node yourself")
    if args.nnodes > 1 and not args.local_nodes and not (args.rdzv_endpoint and args.rdzv_id):
        refuse("several nodes need --rdzv-endpoint HOST:PORT (node 0's, reachable from "
               "every node) and --rdzv-id (the same on every node, e.g. the run's name), "
               "or --local-nodes to start them all on this machine")
    if not 0 < args.heartbeat_timeout_s <= MAX_COLLECTIVE_S:
        refuse(f"--heartbeat-timeout-s {args.heartbeat_timeout_s:g} is out of range: pass "
               f"seconds above 0, at most {MAX_COLLECTIVE_S:.0f}")


def torchrun_args(args: argparse.Namespace, command: list[str]) -> list[str]:
    out = ["--nproc-per-node", str(args.nproc_per_node), "--nnodes", str(args.nnodes),
           "--max-restarts", "0", "--shutdown-timeout", str(args.grace_seconds)]
    if args.rdzv_endpoint is None:  # one node, nothing asked: a free local port
        out.append("--standalone")
    else:  # one node on the port asked for, or several nodes meeting there
        out += ["--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint,
                "--rdzv-id", args.rdzv_id or DEFAULT_RDZV_ID]
    # `--` first: argparse would take a command argument like `--run` for an abbreviation of
    # one of torchrun's own options.
    return [*out, "--no-python", "--", *command]


def main(argv: list[str] | None = None) -> int:
    args, command = parse(sys.argv[1:] if argv is None else argv)
    if args.local_nodes and args.nnodes > 1:
        from .nodes import run_local_nodes  # imports this module: not at the top

        return run_local_nodes(MODULE, args, command)
    beats = Path(tempfile.mkdtemp(prefix="ckpt-rank-beats-"))
    # torchrun hands its own environment to every rank: this is where each one beats.
    os.environ[Env.RANK_BEATS] = str(beats)
    watch = RankWatch(beats, args.heartbeat_timeout_s)
    watch.start()
    try:
        return run_torchrun(args, command, watch)
    finally:
        watch.stop()
        shutil.rmtree(beats, ignore_errors=True)


def run_torchrun(args: argparse.Namespace, command: list[str], watch: RankWatch) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    quiet_torchrun(args)
    try:
        torchrun.run(torchrun.parse_args(torchrun_args(args, command)))
    except ChildFailedError as e:
        codes = {rank: f.exitcode for rank, f in e.failures.items()}
        # A rank the watch killed for its silence was lost, not killed by a signal: its
        # SIGKILL is the watch's, the cause is its freeze.
        codes.update({rank: Outcome.RANK_LOST.exit_code for rank in watch.lost})
        code = attempt_exit(codes)
        print(ended_line(code, codes), file=sys.stderr, flush=True)
        return code
    except SignalException as e:
        # Asked to stop: every rank was passed the signal and had the grace to commit.
        return 128 + int(e.sigval)
    return Outcome.SUCCESS.exit_code


def quiet_torchrun(args: argparse.Namespace) -> None:
    """torchrun's own lines about its ranks (a failed rank's exit code and pid, the ranks it
    closes, the OMP_NUM_THREADS banner) are said once here, in the outcomes' words
    (`ended_line`), so that what a user reads last is the cause, not torchrun's echo of it."""
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(
        logging.CRITICAL)
    if args.nproc_per_node > 1:  # what torchrun sets then, without its banner
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def ended_line(code: int, rank_codes: dict[int, int]) -> str:
    ranks = ", ".join(f"rank {r} exited {c}" for r, c in sorted(rank_codes.items()))
    return (f"{PROG}: the attempt ended {Outcome.of_exit(code).value} (exit {code}): {ranks}; "
            "the ranks' own lines above say why")


if __name__ == "__main__":
    sys.exit(main())
