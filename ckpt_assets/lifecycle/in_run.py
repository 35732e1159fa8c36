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

* only outcomes in `IN_RUN_OUTCOMES`, the trainer's own death while its worker lives. A
  SIGTERM of the trainer (`preempted`) is left to the sensors: a preemption notice goes to
  the whole pod or node, so the run worker is about to be stopped too, and a trainer
  relaunched beside it would be killed again mid-start (or, worse, outlive a worker the
  reconciler then declares lost). The sensors resume it as a new run once the worker is
  gone, within the preemption budget.
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

from dagster import DagsterRunStatus

from ckpt_assets.attempt.end import AttemptEnd
from ckpt_assets.lifecycle.ended import liveness_outcome
from ckpt_assets.lifecycle.policy import Budget, Decision, decide
from ckpt_assets.lifecycle.state import RunState, State, state_observation
from ckpt_assets.runs.clock import iso
from ckpt_assets.runs.settings import ResumeSettings
from ckpt_assets.runs.tags import TAG_ATTEMPT, TAG_ATTEMPT_STARTED_AT, TAG_BUDGET
from ckpt_assets.runs.view import RunView
from trainer.outcomes import Outcome

# The trainer died and nothing says its run worker is about to: a relaunch here is safe.
# (A rank that only lost its peers is such a death too: the peer's process died or hung.)
IN_RUN_OUTCOMES = frozenset({Outcome.KILLED_BY_SIGNAL, Outcome.STORAGE_UNAVAILABLE,
                             Outcome.RANK_LOST})


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


def consider_relaunch(context, ended: AttemptEnd, interrupted: bool,
                      settings: ResumeSettings) -> Decision | None:
    """`relaunch_decision` for the step's own run, read from its tags as they are now."""
    run = context.instance.get_run_by_id(context.run.run_id) or context.run
    view = RunView.of(run)
    return relaunch_decision(ended, Budget.from_tag(view.budget), settings,
                             interrupted=interrupted, stop_requested=view.stop_requested,
                             taken_over=liveness_outcome(run) is not None
                             or run.status != DagsterRunStatus.STARTED)


def relaunch_words(ended: AttemptEnd, decision: Decision) -> str:
    wait = f" after a back-off of {decision.delay_s:.0f}s" if decision.delay_s > 0 else ""
    return (f"attempt {ended.attempt} ended {ended.outcome.value} (exit {ended.exit_code}) "
            f"while the run worker lives: relaunching the trainer in this run as attempt "
            f"{ended.attempt + 1}{wait}, from the newest verified checkpoint (step "
            f"{ended.last_committed_step}); {decision.reason}")


def record_relaunch(context, ended: AttemptEnd, decision: Decision) -> None:
    """Carry the used budget on the run (a later sensor resume continues the count) and
    say what happens, in the run's log and as the partition's state."""
    # The new attempt's start: liveness judges its trainer from it, not from the run's.
    context.instance.add_run_tags(context.run.run_id, {
        TAG_BUDGET: decision.budget.to_tag(), TAG_ATTEMPT: str(ended.attempt + 1),
        TAG_ATTEMPT_STARTED_AT: iso(time.time() + decision.delay_s)})
    words = relaunch_words(ended, decision)
    context.log.warning(words)
    context.log_event(state_observation(
        RunState(ended.training_run, State.RESUMING, words, context.run.run_id,
                 ended.attempt + 1),
        {"relaunched_in_run": True, "failure_class": ended.outcome.value,
         "failure_kind": decision.kind.value, "reason": decision.reason,
         "delay_s": float(decision.delay_s), "budget": decision.budget.to_tag()}))


def serve_backoff(decision: Decision, sleep=time.sleep) -> None:
    """Sleep out the policy's back-off (bounded by `in_run_max_delay_s` when decided)."""
    if decision.delay_s > 0:
        sleep(decision.delay_s)
