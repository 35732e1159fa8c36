"""Every rank watched: each rank's liveness beat, and the launcher that acts on a silent one.

Rank 0's heartbeat in the store tells the orchestrator that the attempt lives; it says
nothing of the other ranks. A rank frozen by SIGSTOP (a debugger, a node that swaps) holds
no socket error for its peers to see, so without this they would wait for it up to
`checkpoint.collective_timeout_s` (600 s by default).

* Each rank (`RankBeat`, started by the session's `restore()` on every rank of a launch by
  `python -m trainer.ranks`) keeps a file of its own in a directory the launcher names
  (`CKPT_RANK_BEATS`): `rank-<RANK>`, holding its pid, its mtime moved every `BEAT_S` by a
  thread of its own, whatever a step costs. A local file, not the store: a beat costs one
  `utime` and every rank of a node shares the launcher's machine. The session's end removes
  it (what a process does after its session is not the attempt's liveness).
* The launcher (`RankWatch`, on a thread beside torchrun's agent) looks at every beat file
  each `poll_s`: a rank whose beat is older than the heartbeat timeout while its process
  still exists is lost. The launcher SIGKILLs it (a stopped process still dies of SIGKILL);
  its peers then see their collectives fail at once (a closed connection, not a timeout),
  torchrun stops the rest, and the launcher exits `rank_lost` (7), resumed. A rank is
  judged only once it has beaten: none is declared dead before its first beat was due.

Several nodes: each node's launcher watches its own ranks; a rank killed on one node fails
the collectives of every other node's ranks, which end as `rank_lost` too.

Standalone: no torch, no dagster.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from ..base.process_id import EXITED, stat_fields
from ..process.contract import Env
from ..process.signals import on_a_helper_thread

log = logging.getLogger("trainer.ranks.rank_watch")

BEAT_S = 1.0  # a rank's beat interval: a utime of a local file, cheap at any rate
PREFIX = "rank-"


def beat_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"{PREFIX}{rank}"


class RankBeat:
    """One rank's liveness beat (the module's docstring); inert outside `trainer.ranks`."""

    def __init__(self, rank: int, directory: str | None = None, every_s: float = BEAT_S):
        directory = directory if directory is not None else os.environ.get(Env.RANK_BEATS)
        self.path = beat_file(directory, rank) if directory else None
        self.every_s = every_s
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckpt-rank-beat", daemon=True)

    def start(self) -> None:
        if self.path is None:
            return
        # Written whole under another name, then renamed: the launcher never reads half a pid.
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            tmp.write_text(str(os.getpid()))
            tmp.replace(self.path)
        except OSError as e:  # unwatched is what a run outside the launcher is anyway
            log.warning("rank liveness beat %s could not be written (%s): this rank is "
                        "watched only by the collective timeout", self.path, e)
            self.path = None
            return
        self._thread.start()

    def stop(self) -> None:
        """No beat after this returns; the file is gone, so the launcher stops judging."""
        if self.path is None or self._ended.is_set():
            return
        self._ended.set()
        self._thread.join(5.0)
        self.path.unlink(missing_ok=True)

    def _run(self) -> None:
        on_a_helper_thread()
        while not self._ended.wait(self.every_s):
            try:
                os.utime(self.path)
            except OSError:  # removed under us (the launcher's directory is gone): stop
                return


def child_exists(pid: int, parent: int) -> bool:
    """Is `pid` a child of `parent` that has not exited (stopped counts: it still exists)?
    A pid reused by another process is not our child."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] not in EXITED and int(fields[1]) == parent


class RankWatch:
    """The launcher's watch over its ranks' beats (the module's docstring)."""

    def __init__(self, directory: Path, timeout_s: float, poll_s: float | None = None):
        self.directory = directory
        self.timeout_s = timeout_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 4)
        self.lost: dict[int, int] = {}  # rank -> pid of every rank this watch killed
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckpt-rank-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._ended.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        on_a_helper_thread()  # torchrun's agent takes the stop signals on its main thread
        while not self._ended.wait(self.poll_s):
            try:
                self.check(time.time())
            except Exception:  # the watch must outlive a bad read; torchrun goes on
                log.exception("watching the ranks' beats in %s failed", self.directory)

    def check(self, now: float) -> None:
        """Kill every rank of this launcher whose beat is older than the timeout."""
        for path in self.directory.glob(f"{PREFIX}*"):
            try:
                rank = int(path.name[len(PREFIX):])
                pid = int(path.read_text())
                age = now - path.stat().st_mtime
            except (OSError, ValueError):  # removed at the session's end, or mid-rename
                continue
            if age > self.timeout_s and rank not in self.lost and child_exists(pid, os.getpid()):
                self._lose(rank, pid, age)

    def _lose(self, rank: int, pid: int, age: float) -> None:
        self.lost[rank] = pid
        print(f"trainer.ranks: rank {rank} (pid {pid}) sent no liveness beat for {age:.0f}s "
              f"(heartbeat timeout {self.timeout_s:g}s): it is frozen (SIGSTOP, a debugger, "
              "swapping) or held the GIL that long. It is killed and the attempt ends as "
              "rank_lost; it resumes from the newest checkpoint", file=sys.stderr, flush=True)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
