"""The reconciler's judgement of a running attempt's trainer, and how a trainer declared
failed is retired before its resume is launched.

Liveness is not progress (`trainer.process.liveness`): the trainer's heartbeat beats on a thread of
its own, so a step of any length keeps it fresh. Each STARTED training run is judged on two
clocks:

* dead: no heartbeat of this run's trainer within CKPT_HEARTBEAT_TIMEOUT_S (120 s), outcome
  `heartbeat_lost`; a run without a live trainer (none has beaten since the run started, or
  its trainer's session ended) is given CKPT_WORKER_GRACE_S (300 s) for the run worker's own
  work before and after it, then judged the same way;
* stalled: a fresh heartbeat, but no step completed within CKPT_STALL_TIMEOUT_S (1800 s),
  outcome `stalled`.

Before such a run is marked failed (which is what lets the failure sensor launch its
resume), its trainer is retired, in this order:

1. the run is tagged with the verdict, so that whichever sensor sees it end classifies it by
   the verdict, not by the exit that what follows causes;
2. the run is fenced (`CheckpointRepo.fence`): the pointer is rewritten by the reconciler
   and refuses the attempt's claim, so the old trainer never commits again (its next commit
   and its next step exit 6) wherever it runs;
3. a trainer on this machine (its beat names this machine, and its pid still has the
   start time the beat recorded: `trainer.base.process_id`) is stopped: SIGTERM and
   SIGCONT to its process group (a frozen process acts on SIGTERM only once continued), a
   grace, SIGKILL, and it is seen gone; a trainer the fence could not reach (whatever the store's error; a frozen one
   holding the local store's pointer lock is one) gets no grace, in which it could commit:
   SIGKILL at once, then the fence again. A trainer elsewhere, or one that cannot be
   identified, is asked to stop through the attempt's launcher (Dagster run termination);
   fencing is the backstop.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass

import dagster as dg

from ckpt_assets.base.process_group import KILL_WAIT_S, POLL_S, group_members
from ckpt_assets.base.store import StoreSource
from ckpt_assets.base.view import RunView
from ckpt_assets.lifecycle.ended import LIVENESS_TAGS, run_repo
from ckpt_assets.lifecycle.model import Event, NotAMove
from ckpt_assets.lifecycle.settings import ResumeSettings
from ckpt_assets.lifecycle.transition import Writes, transition
from trainer.base.outcomes import Outcome
from trainer.base.process_id import ProcessId
from trainer.checkpoints.records import Beat


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome  # Outcome.HEARTBEAT_LOST or Outcome.STALLED
    reason: str


def read_beat(store: StoreSource, partition: str) -> Beat | None:
    """The newest heartbeat of training run `partition`, None if it has none; a store that
    cannot be read raises (no evidence either way: the caller judges nothing)."""
    repo = run_repo(store, partition)
    return repo.read_beat() if repo else None


def own_beat(beat: Beat | None, run_id: str, attempt: int | None = None) -> Beat | None:
    """`beat` if the trainer of Dagster run `run_id`'s attempt `attempt` wrote it (an older
    attempt's trainer, alive or not, says nothing about this one's: after an in-run relaunch
    the dead trainer's last beat names the same run); a beat that names no run, or no
    attempt (written before its claim), counts."""
    if beat is None or beat.dagster_run_id not in (None, run_id):
        return None
    if attempt is not None and beat.attempt is not None and beat.attempt < attempt:
        return None
    return beat


def judge(beat: Beat | None, run_id: str, started: float, now: float,
          settings: ResumeSettings, attempt: int | None = None) -> Verdict | None:
    """Dead, stalled, or (None) neither: the trainer of run `run_id`'s attempt `attempt`,
    which started at `started` (the run's start, or the attempt's relaunch in it), as its
    newest heartbeat `beat` shows it at `now`. No trainer is judged before its first beat
    was due: without a beat of its own it has the whole start-up grace from its start."""
    timeout, grace, beat = (settings.heartbeat_timeout_s, settings.worker_grace_s,
                            own_beat(beat, run_id, attempt))
    if beat is None:
        if now - started <= grace:
            return None  # its trainer may still be starting
        return Verdict(Outcome.HEARTBEAT_LOST, (
            f"trainer heartbeat lost (none {now - started:.0f}s after the run started, "
            f"grace {grace:.0f}s)"))
    if beat.ended is not None:
        if now - beat.ended <= grace:
            return None  # the run worker finishes the run (the final model) after it
        return Verdict(Outcome.HEARTBEAT_LOST, (
            f"run worker lost: its trainer ended {now - beat.ended:.0f}s ago and the run has "
            f"not finished (grace {grace:.0f}s)"))
    age = now - beat.time
    if age > timeout:
        return Verdict(Outcome.HEARTBEAT_LOST, (
            f"trainer heartbeat lost ({age:.0f}s old, timeout {timeout:.0f}s)"))
    since = None if beat.step_time is None else now - beat.step_time
    if since is not None and since > settings.stall_timeout_s:
        return Verdict(Outcome.STALLED, (
            f"trainer stalled: alive (heartbeat {age:.0f}s old) but no step completed for "
            f"{since:.0f}s since step {beat.step} (stall limit {settings.stall_timeout_s:.0f}s)"))
    return None


def retire(instance: dg.DagsterInstance, run: dg.DagsterRun, store: StoreSource,
           beat: Beat | None, verdict: Verdict, settings: ResumeSettings) -> str:
    """Tag, fence and stop the trainer of `run`, then mark the run failed (the module's
    docstring says why in this order): the move `trainer silent`; returns what was done, in
    words (nothing, when the run ended meanwhile: no row moves it then)."""
    try:
        return transition(instance, RunView.of(run).partition, Event.TRAINER_SILENT,
                          lambda w: _retire(w, run, store, beat, verdict, settings),
                          run=run).result
    except NotAMove as e:
        return f"not retired: {e}"


def _retire(w: Writes, run: dg.DagsterRun, store: StoreSource, beat: Beat | None,
            verdict: Verdict, settings: ResumeSettings) -> str:
    w.tag(run.run_id, {LIVENESS_TAGS[verdict.outcome]: verdict.reason})
    view = RunView.of(run)
    attempt, partition = view.attempt, view.partition
    fenced, words = fence(store, partition, attempt)
    done = [verdict.reason, words]
    beat = own_beat(beat, run.run_id, view.attempt)
    # The grace lets a fenced trainer end cleanly; one not fenced could commit in it.
    grace = settings.stop_grace_s if fenced else None
    stopped = stop_trainer(beat.process, grace) if beat else None
    done.append(stopped or request_termination(w, run))
    if not fenced:  # e.g. the frozen trainer held the pointer's lock until it was killed
        done.append(f"then: {fence(store, partition, attempt)[1]}")
    words = "; ".join(done)
    # The verdict stays the tag written before acting (what the decision reads); what was
    # done about it goes to the run's own log, which is appended to, never rewritten: the
    # moment the trainer is gone its run worker writes the run's tags too.
    current = w.instance.get_run_by_id(run.run_id)
    # Its run worker may have failed it already (the trainer it waits for is gone); one
    # asked to terminate is CANCELING, and marked failed all the same: the resume must not
    # wait on a worker that may never answer.
    if current is not None and not current.is_finished:
        w.fail(current, f"{words}: marking the run failed")
    else:
        w.instance.report_engine_event(f"retired: {words}", dagster_run=run)
    return words


def fence(store: StoreSource, partition: str, attempt: int) -> tuple[bool, str]:
    """(whether attempts up to `attempt` can no longer commit to the run: fenced, or the
    run has nothing registered to commit to; what happened, in words). A fence that failed
    is no reason not to stop the trainer."""
    try:
        repo = run_repo(store, partition)
        if repo is None:
            return True, "not fenced: the run is not registered in the store"
        ptr = repo.fence(attempt)
    except Exception as e:
        return False, f"NOT fenced ({type(e).__name__}: {e})"
    return True, (f"fenced: attempts up to {attempt} can no longer commit or claim the run "
                  f"(pointer generation {ptr.generation})")


def stop_trainer(proc: ProcessId, grace_s: float | None) -> str | None:
    """Stop the trainer process `proc` and its process group if it runs on this machine:
    SIGTERM and `grace_s` seconds, then SIGKILL (at once when `grace_s` is None); what
    happened, in words, or None when it is not ours to signal (another machine, or it
    cannot be told apart from a process that reuses its pid)."""
    if not proc.here():
        return None
    who = f"trainer pid {proc.pid} on {socket.gethostname()}"
    if not proc.running():
        return f"{who} already gone"
    group = proc.group_now()
    # Its whole process group (the launcher gave it one), never the reconciler's own.
    targets = ([("group", group)] if group == proc.pgid and group not in (None, 0, 1)
               and group != os.getpgrp() else [("pid", proc.pid)])
    try:
        if grace_s is not None:
            _signal(targets, signal.SIGTERM)
            _signal(targets, signal.SIGCONT)  # a frozen process acts on SIGTERM once continued
            if _gone(proc, targets, grace_s):
                return f"{who} stopped by SIGTERM"
        _signal(targets, signal.SIGKILL)
    except PermissionError:
        return None  # not ours: the launcher is asked instead
    how = "at once" if grace_s is None else f"{grace_s:.0f}s after SIGTERM"
    if _gone(proc, targets, KILL_WAIT_S):
        return f"{who} killed (SIGKILL {how})"
    return f"{who} still running after SIGKILL {how}"


def _signal(targets: list[tuple[str, int]], sig: int) -> None:
    for kind, ident in targets:
        try:
            os.killpg(ident, sig) if kind == "group" else os.kill(ident, sig)
        except ProcessLookupError:
            pass


def _gone(proc: ProcessId, targets: list[tuple[str, int]], wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        left = proc.running() or any(kind == "group" and group_members(ident)
                                     for kind, ident in targets)
        if not left:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)


def request_termination(w: Writes, run: dg.DagsterRun) -> str:
    """Ask the attempt's launcher to end it (a trainer on another machine)."""
    try:
        asked = w.terminate_run(run.run_id)
    except Exception as e:
        return f"its launcher could not be asked to terminate it ({type(e).__name__}: {e})"
    return ("its launcher was asked to terminate it" if asked else
            "its launcher could not reach it (fencing keeps it from committing)")
