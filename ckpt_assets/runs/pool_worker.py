"""A run worker of the run pool, from its fork to its run's end.

The fork server (`ckpt_assets.runs.fork_server`) forks a worker either ahead of any run (its
spare) or for the run just asked for. From the fork the worker is a process of its own (a
new session, the server's socket and lock closed), with the environment it was forked for,
and, if the run it waits for trains, it starts the standby trainer (`trainer.process.standby`) its
run's first attempt is to become (`ckpt_assets.attempt.warm_start.keep_pool_standby`): a
spare's imports torch while no run needs it yet, so a run handed to it pays for neither
interpreter. Then it waits on its channel to the server for its run: the launcher's
connection (passed as a file descriptor) and the request. It runs the run only once that
launcher says GO on that connection; without it (the launcher gave up and starts the run
cold) it exits `NOT_RUN_EXIT`, as it does when the server closes the channel unused (the
server exits, or gives the pool up to a fresh server for a code change): its standby dies
with it.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import threading
import traceback
from dataclasses import dataclass

from ckpt_assets.attempt.command import attempt_env
from ckpt_assets.attempt.warm_start import keep_pool_standby
from ckpt_assets.runs.dagster_private import execute_run_here
from ckpt_assets.runs.names import REPO_ROOT
from ckpt_assets.runs.run_pool import GO, read_line

# A forked run worker's exit status when it never ran a run: its run is another worker's
# (started cold), or it had none, so the server must not fail a run when it is reaped. A
# run worker that ran exits as `dagster api execute_run` does: 0, 1, or by a signal.
NOT_RUN_EXIT = 3
# How long a run worker waits for its launcher's GO (it answered the server's reply at
# once, unless it gave up on the pool).
GO_TIMEOUT_S = 60.0


@dataclass
class Worker:
    """A forked run worker as the server sees it: its pid, and its channel until it is
    handed its run."""

    pid: int
    channel: socket.socket


def fork_worker(close_in_child: list[int], env: dict[str, str], standby: bool) -> Worker:
    """Fork a run worker for a run in `env`; with `standby`, it starts its standby trainer
    at once. `close_in_child`: the server's descriptors the worker must not hold. Raises
    OSError."""
    ours, theirs = socket.socketpair()
    try:
        pid = os.fork()
    except OSError:
        ours.close()
        theirs.close()
        raise
    if pid == 0:
        ours.close()
        _worker_main(theirs, close_in_child, env, standby)  # never returns
    theirs.close()
    return Worker(pid, ours)


def hand_run(worker: Worker, conn: socket.socket, request: dict) -> bool:
    """Hand `worker` its run: the launcher's connection and the request. False when the
    worker is gone (it was killed, say): it never runs this run."""
    try:
        socket.send_fds(worker.channel, [b"r"], [conn.fileno()])
        worker.channel.sendall(json.dumps(request).encode() + b"\n")
        return True
    except OSError:
        return False
    finally:
        worker.channel.close()


def _worker_main(channel: socket.socket, close_fds: list[int], env: dict[str, str],
                 standby: bool) -> None:
    code = NOT_RUN_EXIT
    try:
        os.setsid()  # not in the server's (or its starter's) process group or session
        for fd in close_fds:  # else a dead server's lock and socket would live on here
            os.close(fd)
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's
        if standby:
            _start_standby(env)
        handed = _receive_run(channel)
        if handed is not None:
            code = _run_when_told(*handed)
    except SystemExit as e:  # as an interpreter reads it: None is 0, anything else 1
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the run's log, then exit 1
        traceback.print_exc()
        code = 1
    finally:
        exit_as_interpreter(code)


def _start_standby(env: dict[str, str]) -> None:
    """The standby for the run's first attempt, with what a default trainer resource would
    start it with; one that another resource's settings make unfit is replaced in the run
    (`WarmTrainer.warm_up`). Its output is the server's log until the run is handed over."""
    try:
        pid = keep_pool_standby(sys.executable, attempt_env(env), str(REPO_ROOT))
    except OSError as e:  # the run starts its own standby, as a cold run worker does
        print(f"run worker {os.getpid()}: no standby trainer ahead of the run ({e})", flush=True)
        return
    print(f"run worker {os.getpid()}: standby trainer {pid} started ahead of the run", flush=True)


def _receive_run(channel: socket.socket) -> tuple[socket.socket, dict] | None:
    """The launcher's connection and the request; None once the server closed the channel
    without a run."""
    try:
        _, fds, _, _ = socket.recv_fds(channel, 1, 1)
        if not fds:
            return None
        conn = socket.socket(fileno=fds[0])
        request = json.loads(read_line(channel))
    except (OSError, ValueError):
        return None
    finally:
        channel.close()
    return conn, request


def _run_when_told(conn: socket.socket, request: dict) -> int:
    """Wait for the launcher's GO, then become the run's worker and run it: its exit status
    (`NOT_RUN_EXIT` without GO: the launcher gave up on the pool and starts the run cold)."""
    conn.settimeout(GO_TIMEOUT_S)
    try:
        go = read_line(conn) + b"\n" == GO
    except (OSError, ValueError):
        go = False
    conn.close()
    if not go:
        return NOT_RUN_EXIT
    out = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    for src, fd in ((devnull, 0), (out, 1), (out, 2)):
        os.dup2(src, fd)
    os.close(out)
    os.close(devnull)
    os.chdir(request["cwd"])
    os.environ.clear()  # putenv/unsetenv too: the run's subprocesses get the launcher's
    os.environ.update(request["env"])
    return execute_run_here(request["execute_args"])


def exit_as_interpreter(code: int) -> None:
    """End a forked child as an interpreter ends (wait for its non-daemon threads, run its
    exit handlers, flush) but never return into the server's loop."""
    try:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()  # noqa: SLF001 - what interpreter exit runs
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
