"""The training process under Dagster Pipes: start it, stream it, stop it, read its status.

The trainer (or the user's command) runs as its own process: its exit status and its last
Pipes messages are what the failure policy classifies, and its crash never takes the
orchestrator down. It is started in a session of its own and with PR_SET_PDEATHSIG, so
that a killed run worker takes it along (it commits a checkpoint and exits 143), and an
interrupt of the step (terminate from Dagster, Ctrl-C) becomes SIGTERM, then SIGKILL after
the grace period: no zombie keeps training with nobody watching.
"""

from __future__ import annotations

import ctypes
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dagster as dg


class LaunchError(Exception):
    """The process could not be started (no such command, not executable, bad cwd)."""


@dataclass
class ProcessOutcome:
    returncode: int
    interrupted: BaseException | None  # the step's interrupt, re-raised by the caller


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


def _start(argv: list[str], env: dict[str, str], cwd: str) -> subprocess.Popen:
    try:
        return subprocess.Popen(
            argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace",
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            start_new_session=True)
    except FileNotFoundError as e:
        missing = cwd if e.filename == cwd else argv[0]
        what = "working directory" if missing == cwd else "command"
        raise LaunchError(f"{what} {missing!r} does not exist; fix the run config's "
                          f"{'cwd' if missing == cwd else 'command'} (cwd {cwd})") from None
    except (PermissionError, NotADirectoryError, OSError) as e:
        raise LaunchError(f"cannot start {argv[0]!r} in {cwd}: {e.strerror or e}; fix the run "
                          "config's command or cwd") from None


def run_under_pipes(context: dg.AssetExecutionContext, argv: list[str], env: dict[str, str],
                    cwd: str, grace_s: float, on_messages: Callable[[list[Any]], None],
                    after_start: Callable[[], None], extras: dict[str, Any]) -> ProcessOutcome:
    """Run `argv` in a Pipes session until it exits; feed its custom messages to
    `on_messages` as they arrive (and the last ones after it exited)."""
    seen = 0
    interrupted: BaseException | None = None
    with dg.open_pipes_session(context=context,
                               context_injector=dg.PipesTempFileContextInjector(),
                               message_reader=dg.PipesTempFileMessageReader(),
                               extras=extras) as session:
        proc = _start(argv, {**env, **session.get_bootstrap_env_vars()}, cwd)
        context.log.info(f"training process started (pid {proc.pid}): {' '.join(argv)}")
        reader = threading.Thread(target=_pump, args=(proc, context), daemon=True,
                                  name="training-output")
        reader.start()
        try:
            _overlap(after_start, proc)
            while True:
                rc = proc.poll()
                msgs = session.get_custom_messages()
                on_messages(msgs[seen:])
                seen = len(msgs)
                if rc is not None:
                    break
                time.sleep(0.2)
        except BaseException as e:  # DagsterExecutionInterruptedError (terminate), Ctrl-C, ...
            interrupted = e
            rc = stop(context, proc, grace_s)
        reader.join(10)
    # The session is closed: every message the process wrote has been read.
    on_messages(session.get_custom_messages()[seen:])
    return ProcessOutcome(rc, interrupted)


# A Python traceback, as printed: its first line, the chain separators, and the lines that
# continue it (indented frames and source, exception-group borders, blank lines).
TRACEBACK_START = "Traceback (most recent call last):"
CHAIN_LINES = ("During handling of the above exception, another exception occurred:",
               "The above exception was the direct cause of the following exception:")
GROUP_START = "Exception Group Traceback (most recent call last):"  # indented: "  + ..."
BLOCK_IDLE_S = 0.5  # a traceback is written at once; a pause this long ends the block
BLOCK_MAX_LINES = 1000


def _starts(line: str) -> bool:
    return line.startswith(TRACEBACK_START) or line.lstrip(" +").startswith(GROUP_START)


def _continues(line: str, closed: bool) -> bool:
    """Whether `line` belongs to the traceback block being collected: before its exception
    line every line does (frames are indented; the first unindented line is the exception
    line, which `closes` it); after it, only a blank line or a chained traceback does."""
    if _starts(line) or line in CHAIN_LINES or not line.strip():
        return True
    return not closed


def _pump(proc: subprocess.Popen, context) -> None:
    """The process's output as INFO lines, except that a traceback is ONE entry: one event
    per frame line would bury the run's log (the structured `failed` report logs it as an
    error as well, whole)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for raw in proc.stdout:
            lines.put(raw.rstrip())
        lines.put(None)

    threading.Thread(target=read, daemon=True, name="training-output-read").start()
    block: list[str] = []
    closed = False  # the block's exception line was seen

    def flush() -> None:
        nonlocal closed
        if block:
            text = "\n".join(block).rstrip()
            context.log.info(f"[trainer] {text}")
            block.clear()
        closed = False

    while True:
        try:
            line = lines.get(timeout=BLOCK_IDLE_S) if block else lines.get()
        except queue.Empty:
            flush()
            continue
        if line is None:
            flush()
            return
        if block and _continues(line, closed) and len(block) < BLOCK_MAX_LINES:
            if _starts(line) or line in CHAIN_LINES:
                closed = False
            elif line.strip() and line[:1] not in (" ", "\t", "|", "+"):
                closed = True
            block.append(line)
            continue
        flush()
        if _starts(line):
            block.append(line)
        elif line:
            context.log.info(f"[trainer] {line}")


def _overlap(after_start: Callable[[], None], proc: subprocess.Popen) -> None:
    """Run `after_start` (MLflow's start-up: schema migrations on a new database) on its
    own thread while the process starts, so that an interrupt, which Dagster raises in the
    main thread, never lands inside it; the main thread only waits, which is safe."""
    opener = threading.Thread(target=after_start, name="mlflow-open", daemon=True)
    opener.start()
    while opener.is_alive():
        opener.join(0.1)
        if proc.poll() is not None:
            opener.join(30)
            break


def stop(context, proc: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM the process (it commits a checkpoint and exits 143); SIGKILL after grace."""
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
