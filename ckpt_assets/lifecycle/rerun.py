"""A run launched by hand after a failed attempt continues that attempt's chain.

`ckpt-assets run`, `ckpt-assets launch` and the `new_training_run` job launch a training
run's next attempt themselves; it is linked as the sensors' resume would be
(`lifecycle.decision.resume_request`): the failed run is its parent, the chain's root its
root, and it is the next attempt.
"""

from __future__ import annotations

import dagster as dg

from ckpt_assets.base.queries import ENDED_UNSUCCESSFULLY, newest_training_run, training_runs_of
from ckpt_assets.base.registration import Registration
from ckpt_assets.base.view import RunView
from ckpt_assets.lifecycle.ended import failure_from, recorded_end
from ckpt_assets.lifecycle.lost_worker import end_lost_attempt
from ckpt_assets.lifecycle.model import State
from ckpt_assets.lifecycle.state import run_state


def rerun_tags(instance: dg.DagsterInstance, name: str) -> dict[str, str]:
    """A launch after a failed or canceled attempt continues that attempt's chain, as the
    sensors' resume would have (`lifecycle.decision.resume_request`): the failed run is its
    parent, the chain's root its root, and it is the next attempt. The sensors leave a
    failed run alone once a newer run of the partition exists, so it is resumed once."""
    failed = newest_training_run(instance, name)
    if failed is None:
        return {}
    # A run whose worker was killed (a SIGKILLed `ckpt-assets run`) still reads STARTED:
    # ending it is this launch's to do, so that the new run chains onto it.
    failed = end_lost_attempt(instance, failed)
    if failed.status not in ENDED_UNSUCCESSFULLY:
        return {}
    ended, view = recorded_end(instance, failed), RunView.of(failed)
    attempt = (ended.attempt if ended and ended.attempt else None) or (
        view.attempt if view.attempt_tagged else len(training_runs_of(instance, name)))
    # Named as its decision names it: the decision's mirror, else what it will decide from.
    named = view.failure_class or failure_from(failed, ended, None).outcome.value
    return view.next_attempt_tags(attempt + 1, (attempt, named))


def already_finished(instance: dg.DagsterInstance, reg: Registration) -> str | None:
    """Why launching `reg`'s run by hand would train nothing, in words, or None. A run that
    reached its final checkpoint is done (`lifecycle.model`: no row launches a `finished` run);
    training past its end is asked for explicitly, with `checkpoint.continue_finished`."""
    state = run_state(instance, reg.run)
    if state.state is not State.FINISHED or reg.config.checkpoint.continue_finished:
        return None
    return (f"training run {reg.run} already finished ({state.detail}); nothing to train. "
            "To train past its end, set checkpoint.continue_finished: true in its config and "
            "launch it again, or register a new run")
