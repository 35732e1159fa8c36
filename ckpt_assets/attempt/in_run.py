"""Relaunching a dead trainer inside the Dagster run that started it.

When only the trainer died (SIGKILL, the OOM killer, a store outage it gave up on) and the
run worker lives, `model_checkpoint` need not fail its step and wait for a sensor to launch
a new Dagster run: it asks the one failure policy (`ckpt_assets.lifecycle.policy.decide`, over the
same `AttemptEnd` and the `Budget` the run carries on its tags) and, when that resumes,
starts the next attempt itself, from the newest verified checkpoint. Each such attempt is
an attempt like any other: its number is claimed in the store, it has its own
`attempt_ended` observation and MLflow run, and the budget it used is written back onto the
run's `ckpt/budget` tag, so a later sensor resume of the same run continues the count.

What is relaunched here is narrower than what the policy resumes:

* only outcomes in `IN_RUN_OUTCOMES`, the trainer's own end while its worker lives. A
  trainer stopped by SIGTERM (`preempted`) is one of them only when the signal was for the
  trainer alone (its pod deleted while the run worker's pod lives on another node, or a
  signal to its pid): a preemption notice to the whole pod or node reaches the run worker
  too, and a trainer relaunched beside a worker that is stopping would be stopped again
  mid-start. The run worker tells the two apart from what it knows of itself: Dagster turns
  the worker's own SIGTERM/SIGINT into an interrupt of the step's thread
  (`DagsterExecutionInterruptedError`), so a worker that is going has been interrupted, or
  is within moments. `settle_after_preemption` waits those moments
  (`ResumeSettings.in_run_preempt_settle_s`) with the interrupt captured (a flag of its
  own process); an interrupt that arrives meanwhile leaves the attempt to the sensors (the run ends interrupted and is resumed as a
  new run once the worker is gone, within the preemption budget), as does a run whose
  termination Dagster has begun (not STARTED: Dagster marks it CANCELING before it
  interrupts the worker). A notice that reaches the worker later still (a node drained pod
  by pod) stops the relaunched attempt the way any interrupt stops an attempt: it commits,
  exits 143, and the sensors resume the run; nothing is lost but the attempt's start-up.
* only back-offs up to `ResumeSettings.in_run_max_delay_s`, served by sleeping in the step;
  a longer one ends the step, and the reconciler launches the resume when it is due.
* never when the run was interrupted or asked to stop (`ckpt/no_resume`), nor when the
  reconciler has judged its trainer dead or stalled (`LIVENESS_TAGS` on the run) or the run
  is no longer STARTED: the reconciler tags its verdict before it stops the trainer and
  then marks the run failed, so the trainer's death is its doing and the resume is the
  sensors'; a relaunch here would race the resume it launches.

On by default (`Setting.IN_RUN_RELAUNCH`); turned off, every failure goes through the
sensors as a new run.

The policy's answer is the same one a sensor would give: after the step fails with the
last attempt's record, the sensor decides again over that record and the budget on the
tags, and reaches the decision made here (stop, or a back-off too long to serve in-run).
"""

from __future__ import annotations

import time

from dagster import DagsterExecutionInterruptedError, DagsterRunStatus

from ckpt_assets.attempt.process import ProcessOutcome
from ckpt_assets.base.clock import iso
from ckpt_assets.base.dagster_private import (
    capture_interrupts,
    check_captured_interrupt,
    pop_captured_interrupt,
)
from ckpt_assets.base.end import AttemptEnd
from ckpt_assets.base.tags import (
    TAG_ATTEMPT,
    TAG_ATTEMPT_STARTED_AT,
    TAG_BUDGET,
    TAG_INTERRUPTED,
    interrupted_tag,
)
from ckpt_assets.base.view import RunView
from ckpt_assets.lifecycle.ended import liveness_outcome
from ckpt_assets.lifecycle.model import Event
from ckpt_assets.lifecycle.policy import Budget, Decision, decide
from ckpt_assets.lifecycle.settings import ResumeSettings
from ckpt_assets.lifecycle.transition import transition
from trainer.base.outcomes import Outcome

# The trainer ended and nothing says its run worker is about to: a relaunch here is safe.
# (A rank that only lost its peers is such a death too: the peer's process died or hung.)
# A preempted one only once `settle_after_preemption` heard no interrupt of the worker.
IN_RUN_OUTCOMES = frozenset({Outcome.KILLED_BY_SIGNAL, Outcome.STORAGE_UNAVAILABLE,
                             Outcome.RANK_LOST, Outcome.PREEMPTED})


def relaunch_decision(ended: AttemptEnd, used: Budget, settings: ResumeSettings, *,
                      interrupted: bool, stop_requested: bool,
                      taken_over: bool = False) -> Decision | None:
    """The policy's decision to resume `ended` in this run, or None: the step ends and the
    sensors decide (by the same policy) what follows. `taken_over`: the reconciler has
    judged this run's trainer and owns what follows."""
    if not settings.in_run_relaunch or interrupted or stop_requested or taken_over:
        return None
    if ended.outcome not in IN_RUN_OUTCOMES:
        return None
    decision = decide(ended, used, settings.policy)
    if not decision.resume or decision.delay_s > settings.in_run_max_delay_s:
        return None
    return decision


def consider_relaunch(context, ended: AttemptEnd, proc: ProcessOutcome,
                      settings: ResumeSettings) -> Decision | None:
    """`relaunch_decision` for the step's own run, read from its tags as they are now. A
    preempted trainer first waits out `settle_after_preemption`. Meanwhile the run
    worker's own SIGTERM/SIGINT is noted rather than raised mid-decision: it is set on
    `proc` (the step re-raises it once the attempt is recorded) and nothing is relaunched."""
    if not ended.outcome.failed:
        return None
    with capture_interrupts():
        decision = _consider(context, ended, proc.interrupted is not None, settings)
        if decision is not None and ended.outcome is Outcome.PREEMPTED:
            context.log.info(f"attempt {ended.attempt} was stopped by "
                             f"{ended.signal or 'SIGTERM'} while its run worker lives: "
                             f"{settings.in_run_preempt_settle_s:g}s for a stop of the "
                             "worker's own before it is relaunched in this run")
            settle_after_preemption(settings)
            # Read once more: Dagster marks a run it terminates CANCELING before it
            # interrupts the worker, and a stop for good tags the run first.
            decision = _consider(context, ended, False, settings)
        if pop_captured_interrupt():  # the worker is stopping: the sensors' turn
            proc.interrupted = proc.interrupted or DagsterExecutionInterruptedError()
            return None
    return decision


def _consider(context, ended: AttemptEnd, interrupted: bool,
              settings: ResumeSettings) -> Decision | None:
    run = context.instance.get_run_by_id(context.run.run_id) or context.run
    view = RunView.of(run)
    return relaunch_decision(ended, Budget.from_tag(view.budget), settings,
                             interrupted=interrupted, stop_requested=view.stop_requested,
                             taken_over=liveness_outcome(run) is not None
                             or run.status != DagsterRunStatus.STARTED)


SETTLE_LOOK_S = 0.05  # how often the settle looks at the worker's own interrupt flag


def settle_after_preemption(settings: ResumeSettings, interrupted=check_captured_interrupt,
                            clock=time.monotonic, sleep=time.sleep) -> bool:
    """Wait up to `in_run_preempt_settle_s` for the run worker's own SIGTERM/SIGINT (as
    Dagster's handler, under `capture_interrupts`, notes it in this process); whether it
    came. A flag of this process, not another system's record: it ends the wait at once."""
    deadline = clock() + settings.in_run_preempt_settle_s
    while not interrupted():
        if clock() >= deadline:
            return False
        sleep(SETTLE_LOOK_S)
    return True


def relaunch_words(ended: AttemptEnd, decision: Decision) -> str:
    wait = f" after a back-off of {decision.delay_s:.0f}s" if decision.delay_s > 0 else ""
    return (f"attempt {ended.attempt} ended {ended.outcome.value} (exit {ended.exit_code}) "
            f"while the run worker lives: relaunching the trainer in this run as attempt "
            f"{ended.attempt + 1}{wait}, from the newest verified checkpoint (step "
            f"{ended.last_committed_step}); {decision.reason}")


def record_relaunch(context, ended: AttemptEnd, decision: Decision) -> None:
    """The move `relaunched in its run`: carry the used budget on the run (a later sensor
    resume continues the count) and say what happens, in the run's log and as the
    partition's state."""
    words = relaunch_words(ended, decision)
    run = context.instance.get_run_by_id(context.run.run_id) or context.run
    # The new attempt's start: liveness judges its trainer from it, not from the run's. The
    # ended attempt joins the chain's interrupted ones, by the name its attempt_ended has.
    transition(context.instance, ended.training_run, Event.RELAUNCHED_IN_RUN,
               lambda w: w.tag(context.run.run_id, {
                   TAG_BUDGET: decision.budget.to_tag(), TAG_ATTEMPT: str(ended.attempt + 1),
                   TAG_ATTEMPT_STARTED_AT: iso(time.time() + decision.delay_s),
                   TAG_INTERRUPTED: interrupted_tag(RunView.of(run).interrupted,
                                                    (ended.attempt, ended.outcome.value))}),
               run=run, context=context, detail=words,
               extra={"relaunched_in_run": True, "ended_attempt": ended.attempt,
                      "failure_class": ended.outcome.value,
                      "failure_kind": decision.kind.value, "reason": decision.reason,
                      "delay_s": float(decision.delay_s), "budget": decision.budget.to_tag()})
    context.log.warning(words)


def serve_backoff(decision: Decision, sleep=time.sleep) -> None:
    """Sleep out the policy's back-off (bounded by `in_run_max_delay_s` when decided)."""
    if decision.delay_s > 0:
        sleep(decision.delay_s)
