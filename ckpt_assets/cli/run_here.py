"""`ckpt-assets run NAME --config FILE`: train a registered run in this process, no daemon.

A CI job (or a user without a daemon) registers the run and runs `train_job` for its
partition in-process (`JobDefinition.execute_in_process`, the same assets, resources and
event log as a launched run), then exits with the attempt's exit code: the trainer's (0
finished, 143 preempted, 2 bad input, ...). Run again after a failure it continues the
chain exactly as the resume sensors would (the failed run as parent, the chain's root, the
next attempt: `rerun_tags`, which `launch` uses too) and the trainer resumes from the
newest checkpoint that verifies. SIGTERM and SIGINT reach the step as an interrupt, as under `dagster asset
materialize`: the trainer commits a checkpoint and exits 143.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import dagster as dg

from ckpt_assets.base.events import ATTEMPT_ENDED, partition_events
from trainer.base.outcomes import Outcome

# What the command exits with when the attempt recorded no exit of its own.
INTERRUPTED = Outcome.PREEMPTED.exit_code
UNKNOWN = Outcome.USER_CODE_ERROR.exit_code
TRACEBACK_LINES = 8  # the user's frames nearest the error, and the exception


@dataclass(frozen=True)
class Attempted:
    """What one `run_in_process` came to: the exit code, and the Dagster run it made (None
    when an interrupt cut the call short before it said)."""

    code: int
    run_id: str | None


def run_in_process(instance: dg.DagsterInstance, name: str, tags: dict[str, str],
                   log_path: Path | None = None) -> Attempted:
    """Run `train_job` for partition `name` here; the attempt's exit code and its run.
    `log_path`: where Dagster's own log goes (None: this terminal)."""
    from ckpt_assets.base.dagster_private import capture_interrupts
    from ckpt_assets.definitions import defs
    from ckpt_assets.defs.jobs import train_job

    job = defs.resolve_job_def(train_job.name)
    interrupted = False
    with capture_interrupts(), _dagster_log(log_path):
        try:
            result = job.execute_in_process(instance=instance, partition_key=name, tags=tags,
                                            raise_on_error=False)
            run_id = result.run_id
        except (KeyboardInterrupt, dg.DagsterExecutionInterruptedError):
            interrupted, run_id = True, None
    run_id = run_id or _newest_run_id(instance, name)
    return Attempted(attempt_exit_code(instance, name, run_id, interrupted), run_id)


def _newest_run_id(instance: dg.DagsterInstance, name: str) -> str | None:
    from ckpt_assets.base.queries import newest_training_run

    newest = newest_training_run(instance, name)
    return newest.run_id if newest else None


@contextmanager
def _dagster_log(path: Path | None) -> Iterator[None]:
    """Dagster's console log (its DEBUG events, an interrupt's stack traces) into `path`:
    a user reads the summary `run` prints at the end, and the file when they need more.
    Dagster binds its console handler to `sys.stderr` when the run starts, so the
    redirection holds for the whole run."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f, redirect_stderr(f), redirect_stdout(f):
        yield


def summary(instance: dg.DagsterInstance, name: str, attempted: Attempted,
            daemon: bool) -> str:
    """What `ckpt-assets run` says at the end: how the attempt ended, its last committed
    step, the end of the user's traceback when the training code raised, and what comes
    next (no sensor is promised where no daemon runs)."""
    code = attempted.code
    ended = run_end(instance, name, attempted.run_id)
    step = ended.get("last_committed_step")
    where = f" ({ended['checkpoint_uri']})" if ended.get("checkpoint_uri") else ""
    outcome = Outcome.parse(ended.get("failure_class")) or Outcome.of_exit(code)
    if outcome is Outcome.SUCCESS:
        return f"training run {name} finished at step {step}{where}"
    committed = (f"last committed step {step}{where}" if step is not None else
                 "nothing committed yet")
    head = (f"attempt {ended.get('attempt', '?')} of training run {name} ended "
            f"{outcome.value} (exit {code}); {committed}")
    if not outcome.kind.resumable:  # the cause, for the user to act on
        if tail := _traceback_tail(instance, attempted.run_id):
            head += "\n" + "\n".join(f"  {line}" for line in tail)
        elif ended.get("message"):
            kind = f"{ended['error_type']}: " if ended.get("error_type") else ""
            head += f"\n  {kind}{ended['message']}"
        return f"{head}\nnot resumed: {outcome.kind.advice}"
    if daemon:
        return f"{head}\nthe resume sensors resume it ({outcome.kind.resume})"
    where_from = f"from step {step}" if step is not None else "from the start"
    return (f"{head}\nno daemon runs here: run `ckpt-assets run {name}` again to resume it "
            f"{where_from}")


def run_end(instance: dg.DagsterInstance, name: str, run_id: str | None) -> dict:
    """How run `run_id`'s last attempt ended: its `attempt_ended` observation, else the
    record its step failed with (an attempt refused before its trainer started: a config
    that cannot be found, a changed dataset), so that the summary, the exit code and `list`
    give it one name."""
    from ckpt_assets.base.view import RunView
    from ckpt_assets.lifecycle.ended import recorded_end

    ends = [md for md, rec in partition_events(instance, name, ATTEMPT_ENDED)
            if rec.run_id == run_id]
    if ends:
        return ends[-1]
    run = instance.get_run_by_id(run_id) if run_id else None
    recorded = recorded_end(instance, run) if run is not None else None
    if recorded is None:
        return {}
    return {**recorded.to_dict(), "attempt": recorded.attempt or RunView.of(run).attempt}


def _traceback_tail(instance: dg.DagsterInstance, run_id: str | None) -> list[str]:
    """The last lines of the traceback the training code raised, as its step failure
    recorded it: the frames nearest the error and the exception itself."""
    if run_id is None:
        return []
    for rec in instance.all_logs(run_id, of_type=dg.DagsterEventType.STEP_FAILURE):
        data = rec.dagster_event.step_failure_data
        md = data.user_failure_data.metadata if data and data.user_failure_data else {}
        if "traceback" in md:
            text = str(md["traceback"].value).strip().strip("`").strip()
            return _without_launch_frames(text.splitlines())[-TRACEBACK_LINES:]
    return []


# Frames of how the script was started (the standby that ran it, runpy), not of its code.
LAUNCH_FRAMES = ('File "<frozen runpy>"', "trainer/process/standby.py", "/runpy.py\"")


def _without_launch_frames(lines: list[str]) -> list[str]:
    out, skipping = [], False
    for line in lines:
        if line.startswith("  File "):
            skipping = any(mark in line for mark in LAUNCH_FRAMES)
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            out.append(line)
    return out


def attempt_exit_code(instance: dg.DagsterInstance, name: str, run_id: str | None,
                      interrupted: bool) -> int:
    """The exit code the run's attempt recorded (its `attempt_ended` observation, else its
    step failure's record)."""
    run = instance.get_run_by_id(run_id) if run_id else None
    if run is not None and run.status == dg.DagsterRunStatus.SUCCESS:
        return Outcome.SUCCESS.exit_code
    ended = run_end(instance, name, run_id)
    if isinstance(ended.get("exit_code"), int):
        return failed_exit_code(ended["exit_code"], ended.get("failure_class"))
    outcome = Outcome.parse(ended.get("failure_class"))
    if outcome is not None and outcome.exit_code:
        return outcome.exit_code
    return INTERRUPTED if interrupted else UNKNOWN


def failed_exit_code(exit_code: int, failure_class: str | None) -> int:
    """The exit code of a run that did not succeed: never 0, so that a CI job goes red. A
    trainer that exited 0 without finishing (a command that committed nothing, one that
    left its loop early) exits with its outcome's code, or 1 where the outcome has none."""
    if exit_code != 0:
        return exit_code
    outcome = Outcome.parse(failure_class)
    return (outcome.exit_code if outcome is not None and outcome.exit_code else
            UNKNOWN)
