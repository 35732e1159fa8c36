"""Liveness is not progress: the trainer's heartbeat, beaten on a thread of its own.

The heartbeat (`<experiment>/<run>/heartbeat.json`, one `Beat`) says two things apart:

* the process is alive: `time`, rewritten every `heartbeat_seconds` by a background thread
  from `CheckpointSession.restore()` until the session ends, however long a step takes (a
  compiled first step, a large gradient accumulation, a slow first read of S3 data);
* how far it got: `step`, the last completed step (the resumed one until the first step
  of the attempt), and `step_time`, when it was reached;
* that it is over: the session's last beat carries `ended`, the time it ended (what the
  run worker does after its trainer, such as evaluating the final model, is not the
  trainer's liveness).

The orchestrator judges them apart: a heartbeat older than CKPT_HEARTBEAT_TIMEOUT_S means the
trainer is gone or frozen; a fresh heartbeat whose step has not moved for
CKPT_STALL_TIMEOUT_S means it is alive but stuck. Both end the attempt, each with its own
outcome (`heartbeat_lost`, `stalled`).

A beat also says which process wrote it (`ProcessId`: its machine, that is the boot and
the PID namespace, its pid, process group and start time in clock ticks since boot; and the
host's name, for people), so that a reconciler on the same machine stops exactly that
trainer, never a later process that reuses its pid.

The thread never writes once the session ended (the ending beat is written by the session's
end itself, and not at all by a superseded attempt or one whose beats were failing), nor
once it saw that its attempt was superseded (the run's pointer no longer names this attempt's claim as its owner: a newer
attempt claimed the run, or the orchestrator fenced it); the session then fails its next
step with exit 6. A store error while beating is logged, never raised: training goes on,
and the commit path reports storage errors.

Standalone (`trainer/` never imports dagster); the orchestrator reads `Beat`
(`trainer.checkpoints.records`) and tells processes apart by `trainer.base.process_id`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from ..base.process_id import ProcessId
from .signals import on_a_helper_thread

if TYPE_CHECKING:
    from ..checkpoints.repo import CheckpointRepo

log = logging.getLogger("trainer.heartbeat")

# heartbeat_seconds = 0 beats after every completed step; between steps (a long one) it
# still beats this often, so that liveness never depends on step length.
EVERY_STEP_IDLE_S = 1.0
# How long the end of a session waits for a beat already being written (a store that hangs
# must not hold the process; the commit path has its own timeouts and errors).
STOP_WAIT_S = 30.0
class Heartbeat:
    """The background thread that writes a session's beats (see the module's docstring)."""

    def __init__(self, repo: CheckpointRepo, every_s: float,
                 dagster_run_id: str | None = None):
        self.repo = repo
        self.every_step = every_s <= 0
        self.interval = EVERY_STEP_IDLE_S if self.every_step else every_s
        self.fenced = False  # the run's pointer names another owner: this attempt is over
        self._fixed = {**ProcessId.of().to_dict(), "host": socket.gethostname(),
                       "dagster_run_id": dagster_run_id}
        self._progress: dict[str, Any] = {}
        # (last completed step, when it was reached): one attribute, replaced whole by every
        # step without a lock (the per-step call stays cheap), read whole by the thread.
        self._reached: tuple[int | None, float] = (None, time.time())
        self._lock = threading.Lock()  # guards _progress; never held while writing
        self._wake = threading.Event()
        self._ended = threading.Event()
        self._failing_since: float | None = None
        self._thread = threading.Thread(target=self._run, name="ckpt-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def claimed(self, attempt: int, step: int) -> None:
        """The attempt's claim is made: say which attempt it is, and the step it continues
        from (the time of progress stays: a restore that hangs is a stall too)."""
        with self._lock:
            self._progress.update(attempt=attempt, resumed_step=step)
        self._reached = (step, self._reached[1])
        self._wake.set()

    def advance(self, step: int) -> None:
        """Step `step` is complete: progress."""
        self._reached = (step, time.time())
        if self.every_step:
            self._wake.set()

    def stop(self, superseded: bool = False) -> None:
        """End the beats with one that says the session ended (none for an attempt that was
        `superseded`: it writes nothing more). No beat is written after this returns, unless
        one already being written has not finished within STOP_WAIT_S, which is logged."""
        if self._ended.is_set():
            return
        self.fenced = self.fenced or superseded
        self._ended.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(STOP_WAIT_S)
            if self._thread.is_alive():
                log.warning("a heartbeat write to %s has not finished after %.0fs; the "
                            "session ends without waiting for it", self.repo.prefix, STOP_WAIT_S)
                return
        if not self.fenced and self._failing_since is None:
            progress = self._progress_now()
            try:
                self.repo.heartbeat(self._payload({**progress, "ended": time.time()}))
            except Exception as e:
                self._failed(e)

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        on_a_helper_thread()
        while not self._ended.is_set():
            try:
                if not self._beat_once():
                    return  # superseded: this attempt writes nothing more
            except Exception:  # never let the thread die: liveness outlives a bad beat
                log.exception("heartbeat of %s failed unexpectedly", self.repo.prefix)
            self._wake.wait(self.interval)
            self._wake.clear()

    def _progress_now(self) -> dict[str, Any]:
        with self._lock:
            progress = dict(self._progress)
        progress["step"], progress["step_time"] = self._reached
        return progress

    def _beat_once(self) -> bool:
        progress = self._progress_now()
        if "attempt" in progress and not self._still_owner():
            self.fenced = True
            log.error("run %s was taken over (its pointer names another owner): attempt %s "
                      "is superseded and stops beating", self.repo.prefix, progress["attempt"])
            return False
        if self._ended.is_set():
            return True
        try:
            self.repo.heartbeat(self._payload(progress))
        except Exception as e:  # a storage fault: the next beat tries again
            self._failed(e)
        else:
            self._recovered()
        return True

    def _payload(self, progress: dict[str, Any]) -> dict[str, Any]:
        """A beat's fields (`Beat`; the repo adds `time` and `owner`)."""
        return {k: v for k, v in {**self._fixed, **progress}.items() if v is not None}

    def _still_owner(self) -> bool:
        try:
            return self.repo.owns_run()
        except Exception as e:  # cannot tell: keep training; a commit finds out for sure
            self._failed(e)
            return True

    def _failed(self, e: Exception) -> None:
        if self._failing_since is None:
            self._failing_since = time.time()
            log.warning("heartbeat of %s could not be written (%s: %s); training goes on, "
                        "and beats are retried every %.1fs", self.repo.prefix,
                        type(e).__name__, e, self.interval)

    def _recovered(self) -> None:
        if self._failing_since is not None:
            log.warning("heartbeat of %s written again after %.0fs of failures",
                        self.repo.prefix, time.time() - self._failing_since)
            self._failing_since = None
