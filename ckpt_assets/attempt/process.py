"""The training process under Dagster Pipes: start it, stream it, stop it, read its status.

The trainer (or the user's command) runs as its own process: its exit status and its last
Pipes messages are what the failure policy classifies, and its crash never takes the
orchestrator down. An attempt owns its processes:

* The process starts in a session (and process group) of its own, with PR_SET_PDEATHSIG,
  so that a killed run worker takes it along (it commits a checkpoint and exits 143).
* Its stdout and stderr are a file that the step tails, not a pipe: when the run worker
  dies, the trainer's next `print` still succeeds and its stop path still commits.
* When the attempt ends for any reason (the process exited, the step was interrupted),
  every process left in the group is stopped (SIGTERM, then SIGKILL after the grace
  period) and the step waits until the group is gone. A command that forks and exits
  leaves nothing training with nobody watching; the orphans it left are counted, and the
  attempt is classified by `ckpt_assets.attempt.messages` (`unfinished`, never a success).
* The run records its processes (tag `ckpt/processes`: machine, run worker, process
  group, output file). Whoever next looks at a run whose worker died without recording
  its end (`ckpt_assets.lifecycle.state`) records the attempt as ended and stops what it left;
  the next attempt of the partition waits until an earlier attempt's group is gone, and
  removes the output file its dead worker could not.

"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg

from ckpt_assets.attempt.errors import TrainerStartError
from ckpt_assets.attempt.file_tail import whole_lines
from ckpt_assets.attempt.output_log import log_output
from ckpt_assets.attempt.transport import PipesChannels
from ckpt_assets.base.attempt_processes import AttemptProcesses
from ckpt_assets.base.child_start import die_with_parent, stops_held
from ckpt_assets.base.process_group import POLL_S, signal_group, stop_group
from ckpt_assets.base.tags import TAG_PROCESSES
from trainer.base.process_id import ProcessId

if TYPE_CHECKING:  # the standby that may become the attempt's process
    from ckpt_assets.attempt.warm_start import WarmTrainer

LEFTOVER_LOOKBACK = 5  # earlier training runs of the partition whose groups are checked

# The run log line that marks the start (benchmarks/bench_resume_latency.py reads it).
PROCESS_STARTED = "training process started"
# ... and the words in it that say a standby became the process (`ckpt_assets.attempt.warm_start`).
WARM_STARTED = "the standby trainer, which imported torch ahead of it"


@dataclass
class ProcessOutcome:
    returncode: int
    interrupted: BaseException | None  # the step's interrupt, re-raised by the caller
    # Processes of the group that were still running once the main process had exited
    # (or been stopped): a command that forked and exited leaves some.
    left_running: list[int]


# -- processes and groups, by /proc --------------------------------------------------------

OUTPUT_SUFFIX = ".log"


def output_prefix(run_id: str) -> str:
    """The name an attempt's output file (in the temp directory) starts with."""
    return f"ckpt-{run_id[:8]}-"


def leftover_output(procs: AttemptProcesses, run_id: str) -> Path | None:
    """The output file `procs` name, if it is one a run worker of `run_id` on this machine
    made: a tag is anyone's to write, and no other file is ever removed for it."""
    path = Path(procs.output)
    if (procs.worker.here() and path.parent == Path(tempfile.gettempdir())
            and path.name.startswith(output_prefix(run_id)) and path.suffix == OUTPUT_SUFFIX):
        return path
    return None


def start_process(argv: list[str], env: dict[str, str], cwd: str, output: str) -> subprocess.Popen:
    try:
        with open(output, "ab") as out:
            return subprocess.Popen(
                argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
                start_new_session=True)
    except FileNotFoundError as e:
        missing = cwd if e.filename == cwd else argv[0]
        what = "working directory" if missing == cwd else "command"
        raise TrainerStartError(f"{what} {missing!r} does not exist; fix the run config's "
                          f"{'cwd' if missing == cwd else 'command'} (cwd {cwd})") from None
    except (PermissionError, NotADirectoryError, OSError) as e:
        raise TrainerStartError(f"cannot start {argv[0]!r} in {cwd}: {e.strerror or e}; fix the run "
                          "config's command or cwd") from None


def tail(path: str, done: threading.Event) -> Iterator[str]:
    """The lines of the attempt's output as they come, until `done` is set and the file has
    been read to its end (its unfinished last line too)."""
    return whole_lines(path, done.is_set, POLL_S, unfinished_last=True)


def run_to_end(argv: list[str], env: dict[str, str], cwd: str, output: str, grace_s: float,
               log) -> ProcessOutcome:
    """Run `argv` as an attempt's process without Dagster (benchmarks, tools): in a group
    of its own, its output in the file `output`, until it and all it started are gone."""
    proc = start_process(argv, env, cwd, output)
    group = ProcessId.of(proc.pid)
    try:
        rc = proc.wait()
    except BaseException:  # interrupted: nothing of the attempt may outlive it
        signal_group(proc.pid, signal.SIGKILL)
        raise
    return ProcessOutcome(rc, None, stop_group(proc.pid, grace_s, log, group.start_ticks,
                                               reap=proc))


@dataclass(frozen=True)
class Attempt:
    """One attempt's process as the step runs it: what it starts, how long it may take to
    stop, who hears its messages, and how they travel."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    grace_s: float
    on_messages: Callable[[list[Any]], None]  # its custom messages, as they arrive
    after_start: Callable[[], None]  # called once the process runs (MLflow's opening)
    extras: dict[str, Any] = field(default_factory=dict)  # Pipes extras it is told
    # How the context and messages travel (`ckpt_assets.attempt.transport`; default temp
    # files on this machine).
    channels: PipesChannels | None = None
    # The step's standby trainer, which becomes this process if it can, and is refilled for
    # the next attempt once this one has spoken.
    warm: WarmTrainer | None = None


def run_under_pipes(context: dg.AssetExecutionContext, attempt: Attempt) -> ProcessOutcome:
    """Run `attempt` in a Pipes session until its process and every process it started are
    gone, feeding its custom messages to `attempt.on_messages` as they arrive (and the
    last ones at the end)."""
    channels = attempt.channels or PipesChannels.local()
    stop_leftovers(context, attempt.grace_s)
    fd, output = tempfile.mkstemp(prefix=output_prefix(context.run.run_id), suffix=OUTPUT_SUFFIX)
    os.close(fd)
    try:
        with dg.open_pipes_session(context=context,
                                   context_injector=channels.context_injector,
                                   message_reader=channels.message_reader,
                                   extras=attempt.extras) as session:
            outcome = _supervise(context, session, attempt,
                                 {**attempt.env, **session.get_bootstrap_env_vars()}, output)
        # The session is closed: every message the processes wrote has been read.
        attempt.on_messages(session.get_custom_messages()[outcome.seen:])
    finally:
        os.unlink(output)
    return outcome.result


@dataclass
class _Supervised:
    result: ProcessOutcome
    seen: int


def _supervise(context, session, attempt: Attempt, env: dict[str, str],
               output: str) -> _Supervised:
    argv, cwd, warm, grace_s = attempt.argv, attempt.cwd, attempt.warm, attempt.grace_s
    if warm is not None:  # a standby still importing is waited for here, where stops act
        warm.ready(argv, env, cwd)
    # A stop that comes before the `try` that stops the process is held, then delivered in it.
    with stops_held() as held:
        proc = warm.take(argv, env, cwd, output) if warm is not None else None
        warmed = proc is not None
        proc = proc or start_process(argv, env, cwd, output)
        procs = AttemptProcesses(ProcessId.of(), ProcessId.of(proc.pid), output)
        _record(context, procs)
        context.log.info(f"{PROCESS_STARTED} (pid {proc.pid}, its own process group"
                         f"{', ' + WARM_STARTED if warmed else ''}; "
                         f"output {output}): {' '.join(argv)}")
        done = threading.Event()
        reader = threading.Thread(target=log_output, args=(tail(output, done), context),
                                  daemon=True, name="training-output")
        reader.start()
        opener = TrackingOpener(attempt.after_start)
        seen, interrupted = 0, None
    try:
        try:
            held.deliver()
            opener.wait_while_running(proc)
            while (rc := proc.poll()) is None:
                seen = hand_on_messages(session, attempt, seen, env)
                _wait_a_little(proc)
        except BaseException as e:  # DagsterExecutionInterruptedError (terminate), Ctrl-C
            interrupted = e
            rc = stop(context, proc, grace_s)
        # Whatever outlived the main process (a command that forked and exited) is stopped
        # now: the attempt ends when its whole group is gone.
        left = stop_group(proc.pid, grace_s, context.log, procs.group.start_ticks, reap=proc)
    finally:
        done.set()
        reader.join(10)
        opener.finish(context.log)
    _record(context, replace(procs, ended=True))
    return _Supervised(ProcessOutcome(rc, interrupted, left), seen)


MESSAGES_EVERY_S = 0.2  # how often the supervising loop hands on the process's messages


def hand_on_messages(session, attempt: Attempt, seen: int, env: dict[str, str]) -> int:
    """Hand the messages that came since `seen` to `attempt.on_messages`; how many have come.

    A stop (the run's terminate) is held while they are handled and raised after, in the
    loop's wait. Raised inside a database call (MLflow's SQLite store, Dagster's event log),
    it left that call's statement open in the frames the stored exception keeps, and every
    write after it waited out SQLite's lock timeout and failed: 20 s each, minutes in all
    before the run could end canceled."""
    with stops_held() as held:
        msgs = session.get_custom_messages()
        attempt.on_messages(msgs[seen:])
        if msgs and attempt.warm is not None:  # it has started: the next one may get ready
            attempt.warm.refill(attempt.argv, env, attempt.cwd)
    held.deliver()
    return len(msgs)


def _wait_a_little(proc: subprocess.Popen) -> None:
    """Until the next look at the messages, or sooner if the process exits: its death is
    noticed within tens of milliseconds (Popen's own polling), so a relaunch starts at once."""
    try:
        proc.wait(timeout=MESSAGES_EVERY_S)
    except subprocess.TimeoutExpired:
        pass


def _record(context, procs: AttemptProcesses) -> None:
    try:
        context.instance.add_run_tags(context.run.run_id, {TAG_PROCESSES: procs.to_tag()})
    except Exception as e:  # what others read to clean up after a lost worker: never fatal
        context.log.warning(f"could not record the attempt's processes on the run: {e}")


def stop_leftovers(context, grace_s: float) -> None:
    """Before this attempt starts a process: the processes of the partition's earlier
    attempts are gone. An attempt whose run worker died leaves its trainer committing on
    the way out (and a forking command's children); this waits for them, then stops
    whatever is left (SIGTERM, grace, SIGKILL), and removes the output file the dead
    worker could not."""
    from ckpt_assets.base.queries import training_runs_of

    if not context.has_partition_key:
        return
    runs = training_runs_of(context.instance, context.partition_key)
    for run in runs[:LEFTOVER_LOOKBACK]:
        procs = AttemptProcesses.of_run(run)
        if run.run_id == context.run.run_id or procs is None or procs.ended:
            continue
        if procs.left():
            context.log.warning(f"run {run.run_id} left processes of its attempt running "
                                f"(process group {procs.group.pid}); stopping them first")
            procs.stop(grace_s, context.log)
        if procs.worker_gone() and not procs.left():  # its `finally` never ran
            if (leftover := leftover_output(procs, run.run_id)) is not None:
                leftover.unlink(missing_ok=True)


TRACKING_OPEN_WAIT_S = 30.0  # MLflow's start-up on a new database (schema migrations)


class TrackingOpener:
    """`after_start` (MLflow's start-up) on its own thread while the attempt's process
    starts, so that an interrupt, which Dagster raises in the main thread, never lands inside
    it: a run worker stopped mid-migration left the MLflow database half made for every
    later run. The attempt's end waits for it (`finish`), interrupted or not: the attempt's
    record goes to the MLflow run it opened, and the run worker never exits under a thread
    still inside MLflow's start-up.

    Waited for on an Event, never `Thread.join`: a join that an interrupt breaks (Python
    3.11) releases the running thread's own state lock and marks it stopped, so later joins
    return at once, and the interpreter's exit crashed under the thread still running
    ("Fatal Python error: PyThreadState_Get")."""

    def __init__(self, after_start: Callable[[], None]):
        self._done = threading.Event()

        def run() -> None:
            try:
                after_start()
            finally:
                self._done.set()

        threading.Thread(target=run, name="mlflow-open", daemon=True).start()

    def wait_while_running(self, proc: subprocess.Popen) -> None:
        """Until it is done, or the process has exited (then a little longer)."""
        while not self._done.wait(0.1):
            if proc.poll() is not None:
                self.finish(None)
                return

    def finish(self, log) -> None:
        if not self._done.wait(TRACKING_OPEN_WAIT_S) and log is not None:
            log.warning(f"MLflow's start-up is still running after "
                        f"{TRACKING_OPEN_WAIT_S:.0f}s; the attempt's end goes on without it")


def stop(context, proc: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM the training process (it commits a checkpoint and exits 143); SIGKILL after
    grace. Only the main process first: a DataLoader worker signalled with it would die
    under the step it serves; the rest of the group is stopped once it is gone."""
    if proc.poll() is None:
        context.log.warning(f"interrupted: SIGTERM to pid {proc.pid}, grace {grace_s:.0f}s")
        proc.send_signal(signal.SIGTERM)
    while True:
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            context.log.warning(f"pid {proc.pid} still running after {grace_s:.0f}s: SIGKILL")
            proc.kill()
        except BaseException:  # a second interrupt while waiting: do not leave it running
            proc.kill()
