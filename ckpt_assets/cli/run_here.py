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
from pathlib import Path

import dagster as dg

from ckpt_assets.base.events import ATTEMPT_ENDED, partition_events
from trainer.base.outcomes import Outcome

# What the command exits with when the attempt recorded no exit of its own.
INTERRUPTED = Outcome.PREEMPTED.exit_code
UNKNOWN = Outcome.USER_CODE_ERROR.exit_code


def run_in_process(instance: dg.DagsterInstance, name: str, tags: dict[str, str],
                   log_path: Path | None = None) -> int:
    """Run `train_job` for partition `name` here; return the attempt's exit code.
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
    return attempt_exit_code(instance, name, run_id, interrupted)


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


def summary(instance: dg.DagsterInstance, name: str, code: int, daemon: bool) -> str:
    """What `ckpt-assets run` says at the end: how the attempt ended, its last committed
    step, and what comes next (no sensor is promised where no daemon runs)."""
    ended = _last_end(instance, name)
    step = ended.get("last_committed_step")
    where = f" ({ended['checkpoint_uri']})" if ended.get("checkpoint_uri") else ""
    outcome = Outcome.parse(ended.get("failure_class")) or Outcome.of_exit(code)
    head = (f"attempt {ended.get('attempt', '?')} of training run {name} ended "
            f"{outcome.value} (exit {code}); last committed step {step}{where}")
    if outcome is Outcome.SUCCESS:
        return f"training run {name} finished at step {step}{where}"
    if not outcome.kind.resumable:
        return f"{head}\nnot resumed: {outcome.kind.advice}"
    if daemon:
        return f"{head}\nthe resume sensors resume it ({outcome.kind.resume})"
    return (f"{head}\nno daemon runs here: run `ckpt-assets run {name}` again to resume it "
            f"from step {step}")


def _last_end(instance: dg.DagsterInstance, name: str) -> dict:
    ends = [md for md, _ in partition_events(instance, name, ATTEMPT_ENDED)]
    return ends[-1] if ends else {}


def attempt_exit_code(instance: dg.DagsterInstance, name: str, run_id: str | None,
                      interrupted: bool) -> int:
    """The exit code the run's attempt recorded (its `attempt_ended` observation); the
    newest training run's when `run_id` is unknown (the interrupt cut the call short)."""
    from ckpt_assets.base.queries import newest_training_run

    if run_id is None:
        newest = newest_training_run(instance, name)
        run_id = newest.run_id if newest else None
    run = instance.get_run_by_id(run_id) if run_id else None
    if run is not None and run.status == dg.DagsterRunStatus.SUCCESS:
        return Outcome.SUCCESS.exit_code
    for md, rec in partition_events(instance, name, ATTEMPT_ENDED):
        if rec.run_id == run_id and isinstance(md.get("exit_code"), int):
            return failed_exit_code(md["exit_code"], md.get("failure_class"))
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
