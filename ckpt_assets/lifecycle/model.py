"""A training run's life: its states, the events that move it, and who owns each move.

A Kubernetes-style controller in one table. Each row is (state, event) -> next state, the
one module that acts on that event (its owner: nobody else makes that change), and what
it records. An owner moves a run only through `lifecycle.transition.transition`, which
derives the run's state, takes the row for it here (none: the owner does not act), makes
the owner's writes and records the row's next state; everyone else reads the state
(`lifecycle.state.run_state`, derived from the runs and never stored, so it cannot go
stale). A write outside `transition`, or a move by a module that is not the event's owner,
fails tests/project/test_write_owners.py. docs/lifecycle.md is generated from `TABLE`
(tests/orchestrator/test_lifecycle_model.py keeps the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class State(StrEnum):
    NOT_LAUNCHED = "not launched"
    QUEUED = "queued"
    TRAINING = "training"
    STOPPING = "stopping"
    TERMINATING = "terminating"  # terminated from Dagster: a preemption, resumed once it ends
    DECIDING = "deciding"  # an attempt ended; its one decision is not made yet
    WAITING = "waiting for back-off"
    RESUMING = "resuming"
    FINISHED = "finished"
    STOPPED_BY_POLICY = "stopped by policy"
    STOPPED_BY_USER = "stopped by user"


class Event(StrEnum):
    LAUNCHED = "launched"
    ATTEMPT_STARTED = "attempt started"
    CHECKPOINT_COMMITTED = "checkpoint committed"
    RELAUNCHED_IN_RUN = "relaunched in its run"
    ATTEMPT_ENDED = "attempt ended with an outcome"
    WORKER_LOST = "run worker lost"
    TRAINER_SILENT = "trainer silent (heartbeat lost or stalled)"
    DECIDED_RESUME = "decided: resume"
    DECIDED_BACKOFF = "decided: resume after a back-off"
    DECIDED_STOP = "decided: stop"
    BACKOFF_DUE = "back-off due"
    RESUME_LAUNCHED = "resume launched"
    STOP_REQUESTED = "stopped by user"
    TERMINATED = "terminated from Dagster (UI, CLI, run monitoring)"
    FINISHED = "final checkpoint committed"


@dataclass(frozen=True)
class Transition:
    state: State
    event: Event
    next: State
    owner: str  # the module (under ckpt_assets/) that acts on the event
    records: str  # what it writes, where people and the other owners read it


S, E = State, Event
_LAUNCH = ("runs.submit", "a train_job run of the partition; a re-run by hand is tagged as "
           "the failed run's child (lifecycle.rerun)")
_DECIDE = "lifecycle.decision"
_DECIDED = ("the decision, created once in the store (DECISIONS/<run>/<dagster run>.json); "
            "its mirror on the ended run (ckpt/decision, reason, outcome, budget), in its log "
            "and as the partition's state; for an attempt lost with its worker, its end "
            "(attempt_ended, MLflow) by the decision's name")
_STOP = ("lifecycle.stop", "ckpt/no_resume on every active run before it is ended, and a "
         "pending resume withdrawn")

TABLE: tuple[Transition, ...] = (
    Transition(S.NOT_LAUNCHED, E.LAUNCHED, S.QUEUED, *_LAUNCH),
    Transition(S.STOPPED_BY_POLICY, E.LAUNCHED, S.QUEUED, *_LAUNCH),
    Transition(S.STOPPED_BY_USER, E.LAUNCHED, S.QUEUED, *_LAUNCH),
    Transition(S.DECIDING, E.LAUNCHED, S.QUEUED, *_LAUNCH),
    Transition(S.WAITING, E.LAUNCHED, S.QUEUED, *_LAUNCH),
    Transition(S.QUEUED, E.ATTEMPT_STARTED, S.TRAINING, "defs.assets",
               "the run's processes (ckpt/processes); the attempt claimed in the store"),
    Transition(S.RESUMING, E.ATTEMPT_STARTED, S.TRAINING, "defs.assets",
               "the run's processes (ckpt/processes); the attempt claimed in the store"),
    Transition(S.TRAINING, E.CHECKPOINT_COMMITTED, S.TRAINING, "attempt.messages",
               "a checkpoint observation on the partition, MLflow's metrics"),
    Transition(S.TRAINING, E.RELAUNCHED_IN_RUN, S.TRAINING, "attempt.in_run",
               "the next attempt's number, start and budget on the run; a state observation "
               "(a killed trainer at once; a preempted one once its run worker heard no stop "
               "of its own within the settle)"),
    Transition(S.TRAINING, E.FINISHED, S.FINISHED, "defs.assets",
               "attempt_ended (success); the final model"),
    Transition(S.TRAINING, E.ATTEMPT_ENDED, S.DECIDING, "defs.assets",
               "attempt_ended with its outcome; the step's failure carries the AttemptEnd"),
    Transition(S.TRAINING, E.WORKER_LOST, S.DECIDING, "lifecycle.lost_worker",
               "ckpt/worker_lost; the run failed; its processes asked to stop"),
    Transition(S.TRAINING, E.TRAINER_SILENT, S.DECIDING, "lifecycle.liveness",
               "ckpt/heartbeat_lost or ckpt/stalled; the attempt fenced; the run failed"),
    Transition(S.TRAINING, E.STOP_REQUESTED, S.STOPPING, *_STOP),
    Transition(S.QUEUED, E.STOP_REQUESTED, S.STOPPED_BY_USER, *_STOP),
    Transition(S.RESUMING, E.STOP_REQUESTED, S.STOPPED_BY_USER, *_STOP),
    Transition(S.STOPPING, E.ATTEMPT_ENDED, S.STOPPED_BY_USER, "defs.assets",
               "attempt_ended as stopped_by_user"),
    Transition(S.STOPPING, E.WORKER_LOST, S.STOPPED_BY_USER, "lifecycle.lost_worker",
               "ckpt/worker_lost; the run canceled at once; the decision names it "
               "stopped_by_user"),
    Transition(S.TRAINING, E.TERMINATED, S.TERMINATING, "defs.assets",
               "nothing yet: the run's step hears Dagster's interrupt and stops its trainer "
               "(SIGTERM: it commits and exits 143)"),
    Transition(S.TERMINATING, E.ATTEMPT_ENDED, S.DECIDING, "defs.assets",
               "attempt_ended as terminated (not the SIGTERM exit the terminate caused)"),
    Transition(S.TERMINATING, E.WORKER_LOST, S.DECIDING, "lifecycle.lost_worker",
               "ckpt/worker_lost; the run canceled at once; the decision names it "
               "terminated"),
    Transition(S.TERMINATING, E.STOP_REQUESTED, S.STOPPING, *_STOP),
    Transition(S.STOPPING, E.STOP_REQUESTED, S.STOPPING, *_STOP),
    Transition(S.DECIDING, E.DECIDED_RESUME, S.RESUMING, _DECIDE, _DECIDED),
    Transition(S.DECIDING, E.DECIDED_BACKOFF, S.WAITING, _DECIDE, _DECIDED),
    Transition(S.DECIDING, E.DECIDED_STOP, S.STOPPED_BY_POLICY, _DECIDE, _DECIDED),
    Transition(S.DECIDING, E.STOP_REQUESTED, S.STOPPED_BY_USER, *_STOP),
    # Ended and already stopped by what the run shows (a stop for good; an outcome the
    # policy never resumes): the decision only records it.
    Transition(S.STOPPED_BY_USER, E.DECIDED_STOP, S.STOPPED_BY_USER, _DECIDE, _DECIDED),
    Transition(S.STOPPED_BY_POLICY, E.DECIDED_STOP, S.STOPPED_BY_POLICY, _DECIDE, _DECIDED),
    Transition(S.WAITING, E.BACKOFF_DUE, S.RESUMING, "defs.sensors",
               "nothing new: the reconciler requests the resume once due"),
    Transition(S.WAITING, E.STOP_REQUESTED, S.STOPPED_BY_USER, *_STOP),
    Transition(S.RESUMING, E.RESUME_LAUNCHED, S.RESUMING, "defs.sensors",
               "a train_job run tagged with its parent, root, attempt and budget, requested "
               "by the reconciler alone (run_key from the failed run's id: once)"),
)

_ROWS = {(t.state, t.event): t for t in TABLE}


class NotAMove(ValueError):
    """An event the table has no row for in the run's state: its owner must not act."""


def allows(state: State, event: Event) -> bool:
    return (state, event) in _ROWS


def move(state: State, event: Event) -> Transition:
    """The row an owner acts by: its next state is the one the owner records."""
    try:
        return _ROWS[(state, event)]
    except KeyError:
        raise NotAMove(f"a run that is {state} cannot be moved by {event!r}: no row of "
                       "the lifecycle table allows it") from None


def table_markdown() -> str:
    """TABLE as the Markdown table docs/lifecycle.md holds."""
    rows = ["| state | event | next state | owner | records |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| {t.state} | {t.event} | {t.next} | `{t.owner}` | {t.records} |" for t in TABLE]
    return "\n".join(rows)
