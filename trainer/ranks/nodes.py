"""Every node of an attempt on this one machine: what several machines do, on one.

`python -m trainer.ranks --nnodes N --local-nodes ...` starts N launchers of that same
module, one per node, meeting at a c10d rendezvous on a free loopback port as N machines
meet at node 0's endpoint; the orchestrator starts this for a run whose config asks for
several nodes and names no endpoint. It is how a two-node attempt is tried and tested
without a second machine, and it fails as several machines do: each node's launcher is
told of a failure only through its ranks' collectives, so when one node ends badly the
others are asked to stop (SIGTERM: their ranks commit the step they agree on, or find
their peers gone), and are killed after the grace. The attempt's exit status is
`attempt_exit` over the nodes' statuses, as over ranks: a launcher killed by SIGKILL ends
the attempt as killed.

Each launcher gets a SIGTERM from the kernel if this process dies (a SIGKILL, the
orchestrator's step process gone), and passes it to its ranks: no node trains on alone.
"""

from __future__ import annotations

import argparse
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

from ..base.outcomes import Outcome
from ..process.signals import on_a_helper_thread, sigterm_when_parent_dies
from .world import attempt_exit

LOOPBACK = "127.0.0.1"
DEFAULT_RDZV_ID = "local-nodes"


def node_argv(module: str, args: argparse.Namespace, endpoint: str,
              command: list[str]) -> list[str]:
    """One node's launcher: the same options, the shared endpoint, no `--local-nodes`."""
    return [sys.executable, "-m", module, "--nproc-per-node", str(args.nproc_per_node),
            "--nnodes", str(args.nnodes), "--rdzv-endpoint", endpoint,
            "--rdzv-id", args.rdzv_id or DEFAULT_RDZV_ID,
            "--grace-seconds", str(args.grace_seconds),
            "--heartbeat-timeout-s", str(args.heartbeat_timeout_s), "--", *command]


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def run_local_nodes(module: str, args: argparse.Namespace, command: list[str]) -> int:
    """Start every node, wait for the first to end, stop the others if it failed; the
    attempt's exit status."""
    argv = node_argv(module, args, f"{LOOPBACK}:{free_loopback_port()}", command)
    nodes = LocalNodes([subprocess.Popen(argv, preexec_fn=sigterm_when_parent_dies)
                        for _ in range(args.nnodes)])
    stops = {s: signal.signal(s, lambda sig, _f: nodes.tell(sig)) for s in STOPS}
    try:
        if nodes.first_to_end().returncode != 0:
            nodes.tell(signal.SIGTERM)
            nodes.wait_out(args.grace_seconds)
        else:  # the others finish their own last steps and commits: no deadline
            nodes.wait_out(None)
    finally:
        for s, handler in stops.items():
            signal.signal(s, handler)
    return nodes.exit_status()


STOPS = (signal.SIGTERM, signal.SIGINT)


class LocalNodes:
    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.procs = procs
        self.told: set[int] = set()
        self.killed: set[int] = set()  # nodes that outlived the grace after a failure
        self._ended: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._left = len(procs)
        for i, proc in enumerate(procs):
            threading.Thread(target=self._report_end, args=(i, proc), daemon=True,
                             name=f"node-{i}").start()

    def _report_end(self, i: int, proc: subprocess.Popen) -> None:
        # The stop signals go to the main thread, which passes them on; taken here, Python
        # would run their handler only once the main thread woke, at the next node's end.
        on_a_helper_thread()
        proc.wait()
        self._ended.put(i)

    def first_to_end(self) -> subprocess.Popen:
        self._left -= 1
        return self.procs[self._ended.get()]

    def tell(self, sig: int) -> None:
        """Pass a stop to every node still running, once: a second SIGTERM would cut short
        torchrun's own shutdown, the grace its ranks have to commit."""
        for i, proc in enumerate(self.procs):
            if i not in self.told and proc.poll() is None:
                self.told.add(i)
                proc.send_signal(sig)

    def exit_status(self) -> int:
        """The attempt's exit status once every node ended: the worst node's. A node this
        launcher had to kill is an echo of the cause (a lost peer), never the cause: its -9
        must not turn another node's bug into a resumed kill."""
        failed = {i: Outcome.RANK_LOST.exit_code if i in self.killed else p.returncode
                  for i, p in enumerate(self.procs) if p.returncode != 0}
        return attempt_exit(failed) if failed else Outcome.SUCCESS.exit_code

    def wait_out(self, grace: float | None) -> None:
        """The other nodes end by themselves within the grace (their ranks see a peer gone
        at their next collective, or commit the stop they were told), or are killed; with
        no grace, they are waited for."""
        deadline = None if grace is None else time.monotonic() + grace
        try:
            for _ in range(self._left):
                self._ended.get(timeout=None if deadline is None
                                else max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            for i, proc in enumerate(self.procs):
                if proc.poll() is None:
                    self.killed.add(i)
                    proc.kill()
        for proc in self.procs:
            proc.wait()
