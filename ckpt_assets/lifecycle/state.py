"""A training run's state at a glance, derived from its newest Dagster run and its tags.

One function, `run_state`, answers "what is this training run doing?" for `ckpt-assets
list`, and each change of state is also written as a `state` observation on the run's
`model_checkpoint` partition (`state_observation`), so the partition's event history in
the Dagster UI reads as a sequence of states with the reason for each. The state is never
stored as the truth: it is derived every time from the runs, so it cannot go stale.

| state                | the newest training run of the partition                         |
|----------------------|------------------------------------------------------------------|
| not launched         | there is none                                                     |
| queued               | queued or starting, and it is a first attempt                    |
| resuming             | queued or starting as a resume; or failed, resume due, not launched yet |
| training             | running (one whose run worker is found dead is failed first)      |
| stopping             | canceling after a stop for good                                  |
| terminating          | canceling: terminated from Dagster (a preemption, resumed)       |
| waiting for back-off | failed; the policy resumes it after a back-off that has not ended |
| deciding             | failed; the resume sensors have not decided yet (seconds)        |
| finished             | succeeded                                                         |
| stopped by policy    | failed; the policy does not resume it (the reason says why)      |
| stopped by user      | stopped with `ckpt-assets stop` or the `stop_training_run` job   |

What comes next in `deciding`, `waiting for back-off`, `resuming` after a failure and
`queued` is a daemon's to do (the sensors, the run queue). `without_daemon` rewrites such a
state's detail when no dagster-daemon has sent a heartbeat lately, so that `list` never
promises what nobody will do, and says what to run instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import dagster as dg

from ckpt_assets.base.clock import iso
from ckpt_assets.base.events import MODEL_CHECKPOINT_KEY, STATE
from ckpt_assets.base.queries import newest_training_run
from ckpt_assets.base.view import RunView
from ckpt_assets.lifecycle.ended import failure_of, lost_words, lost_worker
from ckpt_assets.lifecycle.model import State
from trainer.base.outcomes import Outcome

ENDED = frozenset({State.NOT_LAUNCHED, State.FINISHED, State.STOPPED_BY_POLICY,
                   State.STOPPED_BY_USER})


@dataclass(frozen=True)
class RunState:
    training_run: str
    state: State
    detail: str  # one line: the reason, or what happens next
    dagster_run_id: str | None = None
    attempt: int | None = None
    resume_at: str | None = None  # ISO 8601 UTC, while waiting for a back-off
    ended: bool = False  # the newest training run ended unsuccessfully (failed or canceled)
    outcome: str | None = None  # how its last attempt ended (`trainer.base.outcomes`), once known
    # How each of the chain's earlier attempts ended (the newest run's `ckpt/interrupted`): a
    # row and the check name an attempt's outcome after a later attempt became the latest.
    interrupted: dict[int, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.state.value}: {self.detail}" if self.detail else self.state.value

    def to_dict(self) -> dict:
        return {"state": self.state.value, "detail": self.detail,
                "dagster_run_id": self.dagster_run_id, "attempt": self.attempt,
                "resume_at": self.resume_at, "outcome": self.outcome,
                "interrupted": [{"attempt": n, "outcome": name}
                                for n, name in self.interrupted.items()]}


def run_state(instance: dg.DagsterInstance, partition: str, now: float | None = None,
              decided: dg.DagsterRun | None = None,
              newest: dg.DagsterRun | None = None) -> RunState:
    """The training run's state, read from its newest Dagster run (and, for one that ended
    undecided, its attempt's own record of how it ended). A read: it changes nothing.
    `decided`: that run as its decider just tagged it, read in its stead; `newest`: the
    newest run, when read already (`queries.newest_training_runs`)."""
    run = newest if newest is not None else newest_training_run(instance, partition)
    if decided is not None and run is not None and run.run_id == decided.run_id:
        run = decided
    if run is None:
        return RunState(partition, State.NOT_LAUNCHED, "no Dagster run yet")
    outcome = None
    view = RunView.of(run)
    if view.ended_unsuccessfully and view.decision is None:
        outcome = failure_of(instance, run, None).outcome
    return state_of(run, time.time() if now is None else now, outcome)


def state_of(run: dg.DagsterRun, now: float, outcome: Outcome | None = None) -> RunState:
    """The state of the training run whose newest training run is `run`; `outcome`: how its
    attempt ended, when it ended and nothing decided yet."""
    view, status = RunView.of(run), run.status
    attempt, partition = view.attempt, view.partition

    def made(state: State, detail: str, resume_at: str | None = None,
             outcome: Outcome | None = None) -> RunState:
        return RunState(partition, state, detail, run.run_id, attempt, resume_at,
                        view.ended_unsuccessfully,
                        outcome.value if outcome else view.failure_class, view.interrupted)

    from_where = view.resume_from or "the latest checkpoint"

    def chain(verb: str) -> str:  # which run this attempt takes over, and from where
        return (f", {verb} run {view.parent_run_id} from {from_where}"
                if view.parent_run_id else "")

    resumed = chain("resuming")
    S = dg.DagsterRunStatus
    if status in (S.QUEUED, S.NOT_STARTED, S.STARTING):
        return made(State.RESUMING if resumed else State.QUEUED,
                    f"attempt {attempt} {status.value.lower()}{resumed}")
    if status == S.STARTED:
        procs = lost_worker(run)
        lost = (f"; {lost_words(procs)}: the reconciler ends it, or "
                f"`{RERUN_HINT.format(run=partition)}` resumes it" if procs else "")
        return made(State.TRAINING, f"attempt {attempt}{chain('continuing')}{lost}")
    if status == S.CANCELING:
        if view.stop_requested:
            return made(State.STOPPING, "stopping for good")
        return made(State.TERMINATING, "terminating; a termination is a preemption, resumed "
                    "once it ends")
    if status == S.SUCCESS:
        # A resumed run reads apart from one never interrupted.
        # An attempt relaunched inside its run was interrupted as much as one resumed in a
        # new run: the count is the attempt's number, whichever way it came.
        interrupted = (f", after {attempt - 1} interrupted attempt(s)" if attempt > 1 else "") \
            + (f": it resumed from {from_where}" if view.parent_run_id and attempt > 1 else "") \
            + "".join(f"; attempt {n} ended {name}" for n, name in view.interrupted.items())
        return made(State.FINISHED, f"attempt {attempt} finished the run{interrupted}",
                    outcome=Outcome.SUCCESS)
    return _ended_unsuccessfully(view, now, made, outcome)


def _ended_unsuccessfully(view: RunView, now: float, made,
                          outcome: Outcome | None) -> RunState:
    if view.stop_requested:
        reason = view.stop_reason
        return made(State.STOPPED_BY_USER, f"stopped on request ({reason})" if reason
                    else "stopped on request")
    reason = view.decision_reason
    if view.decision == "stop":
        return made(State.STOPPED_BY_POLICY, reason)
    if view.decision == "resume":
        due = view.resume_at
        if due is not None and now < due:
            return made(State.WAITING, f"resumes at {iso(due)} (in {due - now:.0f}s); {reason}",
                        iso(due))
        return made(State.RESUMING, f"launching the resume; {reason}")
    lost = f": {view.worker_lost}" if view.worker_lost else ""
    if outcome is not None and not outcome.kind.resumable:
        # Nothing to decide: the policy never resumes this outcome, daemon or not.
        return made(State.STOPPED_BY_POLICY, f"attempt ended {outcome.value}: not resumed: "
                                             f"{outcome.kind.advice}", outcome=outcome)
    named = f" {outcome.value}" if outcome is not None else f" {view.status.value.lower()}"
    return made(State.DECIDING, f"attempt ended{named}{lost}; the resume sensors decide "
                                "within seconds", outcome=outcome)


# A daemon beats every 30 s (dagster's DEFAULT_HEARTBEAT_INTERVAL_SECONDS); missing three
# beats in a row means none is running (dagster's own tolerance, 30 min, is for alerting).
DAEMON_SILENT_AFTER_S = 90.0
# The type names the sensor daemon and the run queue's record their heartbeats under: data in
# the instance's storage, and what Dagster's GraphQL API (`daemonHealth`) takes.
SENSOR_DAEMON, QUEUE_DAEMON = "SENSOR", "QUEUED_RUN_COORDINATOR"
RERUN_HINT = "python -m ckpt_assets run {run}"  # ckpt_assets.cli.run_here: resumes, in-process


def daemon_running(instance: dg.DagsterInstance, daemon_type: str,
                   now: float | None = None, beats: dict | None = None) -> bool:
    """Whether a dagster-daemon running `daemon_type` beat within DAEMON_SILENT_AFTER_S
    (`beats`: the instance's daemon heartbeats, when read already)."""
    beat = (instance.get_daemon_heartbeats() if beats is None else beats).get(daemon_type)
    now = time.time() if now is None else now
    return beat is not None and now - beat.timestamp <= DAEMON_SILENT_AFTER_S


def sensors_running(instance: dg.DagsterInstance) -> bool:
    """Whether a dagster-daemon runs the sensors (the resume sensors act on a failure)."""
    return daemon_running(instance, SENSOR_DAEMON)


def queue_running(instance: dg.DagsterInstance) -> bool:
    """Whether a dagster-daemon dequeues queued runs."""
    return daemon_running(instance, QUEUE_DAEMON)


def without_daemon(instance: dg.DagsterInstance, state: RunState,
                   now: float | None = None, beats: dict | None = None) -> RunState:
    """`state`, its detail rewritten when what comes next needs a daemon that is not running
    (`beats`: the instance's daemon heartbeats, read once for many states)."""
    failed = state.ended and state.state in (State.DECIDING, State.WAITING, State.RESUMING)
    if failed and not daemon_running(instance, SENSOR_DAEMON, now, beats):
        rerun = RERUN_HINT.format(run=state.training_run)
        how = f" {state.outcome}" if state.outcome else ""
        return replace(state, detail=(
            f"attempt {state.attempt} ended{how}, which is resumed, but no daemon is running: "
            f"run `dagster-daemon run` (or `dagster dev`), or resume it here with `{rerun}`"))
    if state.state in (State.QUEUED, State.RESUMING) and not state.ended \
            and not daemon_running(instance, QUEUE_DAEMON, now, beats):
        return replace(state, detail=(
            f"{state.detail}; no daemon is running: it stays queued until `dagster-daemon run` "
            "(or `dagster dev`) dequeues it"))
    return state


def state_observation(state: RunState, extra: dict[str, Any] | None = None
                      ) -> dg.AssetObservation:
    """`state` as an observation on the training run's partition (what the UI shows), with
    `extra` metadata (the decision that led to it)."""
    return dg.AssetObservation(
        asset_key=MODEL_CHECKPOINT_KEY, partition=state.training_run,
        description=f"state: {state}",
        metadata={"event": STATE, **_state_metadata(state),
                  **({"resume_at": state.resume_at} if state.resume_at else {}),
                  **(extra or {})})


# The partition's asset check that reads the state (`ckpt_assets.defs.checks`): Dagster's
# partitions view shows a run stopped for good as "Failed", like a bug, and its events list
# shows no text until an event is opened; a check's partitions show a status and a description.
STATE_CHECK = "training_run_state"
STOPPED = frozenset({State.STOPPED_BY_USER, State.STOPPED_BY_POLICY})


def state_check_result(state: RunState) -> dg.AssetCheckResult:
    """The state as the check's result: failed for a run stopped for good (a warning when a
    user stopped it, an error when the policy did), passed otherwise; the state and its
    reason are the description."""
    return dg.AssetCheckResult(
        check_name=STATE_CHECK, passed=state.state not in STOPPED,
        severity=(dg.AssetCheckSeverity.WARN if state.state == State.STOPPED_BY_USER
                  else dg.AssetCheckSeverity.ERROR),
        description=str(state), metadata=_state_metadata(state))


def state_check_evaluation(state: RunState) -> dg.AssetCheckEvaluation:
    """`state_check_result` as an evaluation recorded outside any run (a sensor, a stop)."""
    result = state_check_result(state)
    return dg.AssetCheckEvaluation(
        asset_key=MODEL_CHECKPOINT_KEY, check_name=STATE_CHECK, passed=result.passed,
        severity=result.severity, description=result.description, metadata=result.metadata,
        partition=state.training_run)


def _state_metadata(state: RunState) -> dict[str, Any]:
    return {"state": state.state.value, "detail": state.detail,
            **({"attempt": state.attempt} if state.attempt else {}),
            # Each outcome by its one name: the latest attempt's, and the chain's earlier ones.
            **({"outcome": state.outcome} if state.outcome else {}),
            **({"interrupted": dg.MetadataValue.json(
                {str(n): name for n, name in state.interrupted.items()})}
               if state.interrupted else {}),
            # A link to the run the state is about.
            **({"dagster_run": dg.MetadataValue.dagster_run(state.dagster_run_id)}
               if state.dagster_run_id else {})}
