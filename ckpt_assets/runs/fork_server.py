"""The run pool's fork server: Dagster and the code location imported once, a run worker
forked from that state for each run (`python -m ckpt_assets.runs.fork_server`).

A run worker started by Dagster's default launcher is a fresh interpreter that imports
Dagster and loads the code location (about 3 s) before the run's first step. This server
pays that once, then waits on a Unix socket in the pool's folder; each request
(`ckpt_assets.runs.run_pool`) is handed to a forked child that becomes the run worker
(`ckpt_assets.runs.pool_worker`): a new session, stdout and stderr to the run's log, the
launcher's environment and the code's working directory, then the run's body exactly as
`dagster api execute_run` runs it (`dagster_private.execute_run_here`). The child is a
process of its own, as a cold run worker is: it outlives this server, and a crash in one
run touches no other.

A training run's trainer is a fresh interpreter too (torch: seconds). So while standby
trainers are on (`CKPT_WARM_TRAINER`), the server keeps one spare worker forked ahead of
any run, whose standby trainer has imported torch by the time a run comes: a training
run is handed the spare and pays for neither interpreter. The next spare is forked
`SPARE_DELAY_S` later. Any other run, or one that comes before the spare is back, gets a
worker forked for it. What it costs: one idle forked worker (its memory shared with this
server's until written) and one idle interpreter with torch imported (about 370 MB),
for as long as the pool lives.

Fork is safe only in a process with one thread (a lock held by another thread at the fork
stays held forever in the child), so the server runs no thread at all, and refuses a fork
(the run then starts cold) if anything it imported started one, native threads included.

A run worker that exits leaving its run unfinished (killed, say) has its run failed, as
Dagster's code server fails the runs of the workers it started: the failure sensors then
see it at once, not at the reconciler's next sweep. The server forks a short-lived child
to write that, so that it never opens the instance (whose storage may start threads).

Code changes: the server records the project's code fingerprint before it imports the code;
a request with another fingerprint makes it give up the pool (socket, lock) and exit, and
the launcher starts a fresh one. It also exits after `--idle-exit-s` without a request,
and, given `--parent-pid`, once that process (the launcher's: a daemon) has exited: a
stopped daemon leaves no interpreter of its pool behind.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import select
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_assets.attempt.process_group import ProcessRef
from ckpt_assets.runs.code_fingerprint import PROJECT_PACKAGES, code_fingerprint
from ckpt_assets.runs.dagster_private import (
    RunCode,
    fail_unfinished_run,
    load_run_code,
)
from ckpt_assets.runs.pool_worker import NOT_RUN_EXIT, Worker, fork_worker, hand_run
from ckpt_assets.runs.run_pool import PoolPaths, read_line
from ckpt_assets.runs.settings import warm_trainer_on

ACCEPT_TICK_S = 0.5  # how often children are reaped and idleness checked
REQUEST_TIMEOUT_S = 5.0
# The next spare is forked this long after the last was handed a run, so that its standby
# trainer's imports do not compete with that run's start for the CPU.
SPARE_DELAY_S = 1.0
LOGS_KEPT = 200  # the pool keeps the output logs of this many newest runs


@dataclass
class Server:
    paths: PoolPaths
    code: RunCode
    fingerprint: str
    lock_fd: int
    listener: socket.socket | None = None
    workers: dict[int, tuple[str, str]] = field(default_factory=dict)  # pid -> (run id, execute args)
    spare: Worker | None = None  # forked ahead of any run, waiting for one
    refill_at: float = 0.0  # when the next spare may be forked

    def log(self, words: str) -> None:
        print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} fork server {os.getpid()}: {words}",
              flush=True)

    def give_up_pool(self) -> None:
        """Close and remove the socket and release the lock, so that a fresh server can take
        the pool at once (before this one has exited)."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
            try:
                self.paths.socket.unlink()
            except FileNotFoundError:
                pass
            self.paths.server_info.unlink(missing_ok=True)
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1
        if self.spare is not None:  # closed unused, it exits: its code is this server's
            self.spare.channel.close()
            self.spare = None


def thread_count() -> int:
    """Threads of this process, native ones included (Python's count where /proc is not)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def take_lock(path: Path) -> int | None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def listen(server: Server) -> None:
    """Bind the pool's socket. The lock is ours, so a socket file there is a dead server's."""
    path = server.paths.socket
    if path.exists() or path.is_symlink():
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Only this user may connect: a request names the code, environment and run a child of
    # this process runs with.
    umask = os.umask(0o177)
    try:
        listener.bind(str(path))
    finally:
        os.umask(umask)
    listener.listen(64)
    server.listener = listener
    server.paths.server_info.write_text(json.dumps({"pid": os.getpid(),
                                                    "fingerprint": server.fingerprint}))


def serve(server: Server, idle_exit_s: float, parent_pid: int | None) -> None:
    last = time.monotonic()
    while server.listener is not None:
        reap(server)
        keep_spare(server)
        if time.monotonic() - last > idle_exit_s:
            server.log(f"no request for {idle_exit_s:g}s; exiting")
            return
        if parent_pid is not None and os.getppid() != parent_pid:  # reparented: it exited
            server.log(f"the process that started it ({parent_pid}) has exited; exiting")
            return
        ready, _, _ = select.select([server.listener], [], [], ACCEPT_TICK_S)
        if not ready:
            continue
        try:
            conn, _ = server.listener.accept()
        except OSError:
            continue
        last = time.monotonic()
        with conn:
            answer(server, conn)


def answer(server: Server, conn: socket.socket) -> None:
    try:
        conn.settimeout(REQUEST_TIMEOUT_S)
        request = json.loads(read_line(conn))
    except (OSError, ValueError) as e:
        server.log(f"an unreadable request ({e}); ignored")
        return
    try:
        reply = decide(server, request) or hand_over(server, conn, request)
    except Exception as e:  # noqa: BLE001 - a malformed request must not end the pool
        reply = {"error": f"a malformed request ({type(e).__name__}: {e})"}
    try:
        conn.sendall(json.dumps(reply).encode() + b"\n")
    except OSError as e:  # the launcher gave up: the run worker never hears GO, and exits
        server.log(f"could not answer the launcher of {request.get('run_id')} ({e})")


def decide(server: Server, request: dict) -> dict | None:
    """The reply that refuses `request`, or None when a run worker is to be forked."""
    if request.get("fingerprint") != server.fingerprint:
        server.log("the code changed since it was loaded; giving the pool up to a fresh server")
        server.give_up_pool()
        return {"restart": "the code changed since this server loaded it"}
    if RunCode(**request["code"]) != server.code:
        return {"error": f"this pool serves {server.code}; the run's code is {request['code']}"}
    threads = thread_count()
    if threads != 1:
        return {"error": f"the server runs {threads} threads (an import started them), and "
                         "forking it could deadlock the run worker; remove what started them "
                         "from the server's imports"}
    return None


def hand_over(server: Server, conn: socket.socket, request: dict) -> dict:
    """Hand the run to the spare worker if the run trains (its standby trainer is warm),
    else, or if the spare is gone, to a worker forked for it now: the reply."""
    trains = bool(request.get("trains"))
    if trains and server.spare is not None:
        spare, server.spare = server.spare, None
        server.refill_at = time.monotonic() + SPARE_DELAY_S
        if hand_run(spare, conn, request):
            return handed(server, spare.pid, request, "forked ahead, its standby trainer ready")
        server.log(f"spare run worker {spare.pid} is gone; forking one for the run")
    try:
        worker = fork_worker(server_files(server), request["env"],
                             trains and warm_trainer_on(request["env"]))
    except OSError as e:
        return {"error": f"fork failed ({e})"}
    if not hand_run(worker, conn, request):
        return {"error": f"run worker {worker.pid} exited before it was handed its run"}
    return handed(server, worker.pid, request, "forked for it")


def handed(server: Server, pid: int, request: dict, how: str) -> dict:
    server.workers[pid] = (request["run_id"], request["execute_args"])
    server.log(f"run worker {pid} ({how}) takes run {request['run_id']}")
    return {"pid": pid, "start": ProcessRef.known(pid).start, "server_pid": os.getpid()}


def keep_spare(server: Server) -> None:
    """Fork the spare run worker, with its standby trainer, unless there is one, one was
    handed a run less than `SPARE_DELAY_S` ago, standbys are off, or forking is unsafe."""
    if (server.spare is not None or time.monotonic() < server.refill_at
            or not warm_trainer_on(os.environ) or thread_count() != 1):
        return
    server.refill_at = time.monotonic() + SPARE_DELAY_S  # a failed fork is not retried at once
    try:
        server.spare = fork_worker(server_files(server), dict(os.environ), standby=True)
    except OSError as e:
        server.log(f"could not fork a spare run worker ({e}); runs get one forked for them")
        return
    server.log(f"forked spare run worker {server.spare.pid}")


def server_files(server: Server) -> list[int]:
    """The descriptors of the server a forked child must close: the socket (the server's
    stays bound), the lock (else a dead server's lock would live on in its children) and
    the spare's channel (else the spare would never see the server exit)."""
    files = [server.lock_fd] if server.lock_fd >= 0 else []
    if server.listener is not None:
        files.append(server.listener.fileno())
    if server.spare is not None:
        files.append(server.spare.channel.fileno())
    return files


def drop_server_files(server: Server) -> None:
    """In a forked child: close the server's descriptors (`server_files`)."""
    for fd in server_files(server):
        os.close(fd)


def reap(server: Server) -> None:
    """Collect the children that ended (run workers, reporters); report each run worker's."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        run = server.workers.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if server.spare is not None and pid == server.spare.pid:
            server.log(f"spare run worker {pid} exited {code} before it had a run")
            server.spare.channel.close()
            server.spare = None
        if run is None:
            continue
        if code == NOT_RUN_EXIT:
            server.log(f"run worker {pid} exited without running its run (no go)")
        else:
            run_id, execute_args = run
            report_worker_exit(server, pid, execute_args, code)
            forget_run(server.paths, run_id)


def forget_run(paths: PoolPaths, run_id: str) -> None:
    """What the pool's folder keeps of a run whose worker has exited: no record (only
    `terminate` reads it, and there is nothing left to interrupt), and its output log while
    it is among the newest `LOGS_KEPT`."""
    paths.run_record(run_id).unlink(missing_ok=True)
    try:
        logs = sorted(paths.runs.glob("*.log"), key=lambda f: f.stat().st_mtime)
        for old in logs[:-LOGS_KEPT]:
            old.unlink(missing_ok=True)
    except OSError:  # a log removed meanwhile: the next exit prunes again
        pass


def report_worker_exit(server: Server, pid: int, execute_args: str, exit_code: int) -> None:
    """Fail the run of run worker `pid` if it ended leaving it unfinished, in a forked child
    (this process stays without the instance's threads); the child is reaped as any."""
    try:
        reporter = os.fork()
    except OSError as e:
        server.log(f"run worker {pid} exited {exit_code}; cannot fork to report it ({e}): "
                   "the reconciler's sweep will find its run")
        return
    if reporter:
        return
    code = 1
    try:
        drop_server_files(server)
        if fail_unfinished_run(execute_args, exit_code):
            server.log(f"run worker {pid} exited {exit_code} leaving its run unfinished; "
                       "the run is failed")
        code = 0
    except BaseException:  # noqa: BLE001 - reported in the server's log
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True, help="the pool's folder")
    ap.add_argument("--module", required=True)
    ap.add_argument("--attribute", required=True)
    ap.add_argument("--working-directory")
    ap.add_argument("--idle-exit-s", type=float, default=3600.0)
    ap.add_argument("--parent-pid", type=int,
                    help="exit once this process, the server's parent, has exited")
    ap.add_argument("--watch", action="append", default=[])
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    roots = [*PROJECT_PACKAGES, *(Path(p) for p in args.watch)]
    fingerprint = code_fingerprint(roots)  # before the import: a change meanwhile is seen
    paths = PoolPaths(Path(args.root))
    lock_fd = take_lock(paths.lock)
    if lock_fd is None:
        print("another fork server holds this pool; exiting", flush=True)
        return 0
    code = RunCode(args.module, args.attribute, args.working_directory, sys.executable)
    server = Server(paths, code, fingerprint, lock_fd)
    t0 = time.monotonic()
    load_run_code(code)
    listen(server)
    server.log(f"loaded {code.module}:{code.attribute} in {time.monotonic() - t0:.2f}s; "
               f"listening on {paths.socket}")
    try:
        serve(server, args.idle_exit_s, args.parent_pid)
    finally:
        server.give_up_pool()
    return 0


if __name__ == "__main__":
    sys.exit(main())
