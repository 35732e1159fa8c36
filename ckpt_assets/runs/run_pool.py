"""The run pool's client: ask the fork server for a run worker, starting the server when
there is none.

The pool lives in one folder (`PoolPaths`, by default `run_pool/` in the instance folder):
the server's Unix socket, its lock (held for its whole life: at most one server per
pool), its log and `server.json` (pid, fingerprint), and per run the run worker's record
(`runs/RUN_ID.json`: pid and start time, read by `terminate`, removed once the worker has
exited) and its stdout/stderr (`runs/RUN_ID.log`, kept for the newest
`fork_server.LOGS_KEPT` runs).

One request, one reply, each a JSON line on a fresh connection. Anything that goes wrong
(no server and none could be started within `start_timeout_s`, no answer within
`reply_timeout_s`, a refusal) raises `PoolUnavailable` with the reason: the launcher then
starts the run cold, as Dagster's default launcher does. A server whose code fingerprint
differs from the request's answers `restart` and exits; the next try starts a fresh one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ckpt_assets.runs.code_fingerprint import PROJECT_PACKAGES, code_fingerprint
from ckpt_assets.runs.dagster_private import RunCode

SERVER_MODULE = "ckpt_assets.runs.fork_server"
SOCKET_NAME = "fork.sock"
# sockaddr_un's sun_path holds 108 bytes with the terminating NUL.
MAX_SOCKET_PATH = 107
POLL_S = 0.05
LINE_LIMIT = 1 << 22  # a request carries a whole environment; nothing sane is this long


class PoolUnavailable(Exception):
    """The pool cannot start this run; the message says why (the run starts cold)."""


@dataclass(frozen=True)
class PoolPaths:
    root: Path

    @property
    def socket(self) -> Path:
        return self.root / SOCKET_NAME

    @property
    def lock(self) -> Path:
        return self.root / "server.lock"

    @property
    def server_log(self) -> Path:
        return self.root / "server.log"

    @property
    def server_info(self) -> Path:
        return self.root / "server.json"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    def run_record(self, run_id: str) -> Path:
        return self.runs / f"{run_id}.json"

    def run_log(self, run_id: str) -> Path:
        return self.runs / f"{run_id}.log"


@dataclass(frozen=True)
class PoolSettings:
    start_timeout_s: float = 30.0  # a busy machine imports Dagster and the code slowly
    reply_timeout_s: float = 5.0
    idle_exit_s: float = 3600.0
    watch: tuple[str, ...] = ()  # more files or folders whose .py files are the code
    # The server exits with the launcher's process: right where that is a daemon (the pool
    # lives as long as what launches runs), wrong where each launch is a short-lived command.
    exit_with_launcher: bool = True


@dataclass(frozen=True)
class Forked:
    """A run worker the server forked: its pid and start time, and the server's pid."""

    pid: int
    start: int
    server_pid: int
    log: str


@dataclass
class RunPool:
    paths: PoolPaths
    settings: PoolSettings = field(default_factory=PoolSettings)
    _servers: list[subprocess.Popen] = field(default_factory=list)

    def roots(self) -> list[Path]:
        return [*PROJECT_PACKAGES, *(Path(p) for p in self.settings.watch)]

    def fork_run(self, run_id: str, code: RunCode, execute_args: str, trains: bool) -> Forked:
        """A run worker for `run_id`, forked by the server (`trains`: the run is a training
        run's, so it is handed the worker whose standby trainer is warm); raises
        PoolUnavailable."""
        self._reap()
        if len(os.fsencode(self.paths.socket)) > MAX_SOCKET_PATH:
            raise PoolUnavailable(f"the pool's socket path {self.paths.socket} is longer than "
                                  f"{MAX_SOCKET_PATH} bytes; set the launcher's "
                                  "pool_directory to a shorter folder")
        request = {"fingerprint": code_fingerprint(self.roots()), "code": asdict(code),
                   "run_id": run_id, "execute_args": execute_args, "trains": trains,
                   "env": dict(os.environ),
                   "cwd": code.working_directory or os.getcwd(),
                   "log": str(self.paths.run_log(run_id))}
        for _ in range(2):  # the second: a fresh server, after one exited for a code change
            reply = self._ask(request, code)
            if isinstance(reply, Forked):
                return reply
            if "restart" not in reply:
                raise PoolUnavailable(f"the pool's server refused the run: {reply.get('error')}")
        raise PoolUnavailable("the pool's server restarted for a code change twice in a row "
                              "(files still changing?); this run starts cold")

    def _ask(self, request: dict, code: RunCode) -> Forked | dict:
        """The forked run worker, told to go; or the server's refusal. The worker runs the
        run only once this launcher said GO on the connection it shares: a launcher that
        gave up waiting (and starts the run cold) closes it instead, and the worker exits
        without running, so a run is never run twice."""
        try:
            conn = self._connect()
        except OSError:
            conn = self._start_server(code)
        with conn:
            conn.settimeout(self.settings.reply_timeout_s)
            try:
                conn.sendall(json.dumps(request).encode() + b"\n")
                reply = json.loads(read_line(conn))
                if "pid" not in reply:
                    return reply
                forked = Forked(int(reply["pid"]), int(reply["start"]),
                                int(reply["server_pid"]), request["log"])
                conn.sendall(GO)
                return forked
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise PoolUnavailable(f"the pool's server at {self.paths.socket} gave no answer "
                                      f"within {self.settings.reply_timeout_s:g}s that it could "
                                      f"use ({e}); its log is {self.paths.server_log}") from e

    def _connect(self) -> socket.socket:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(self.paths.socket))
        except OSError:
            conn.close()
            raise
        return conn

    def _start_server(self, code: RunCode) -> socket.socket:
        """Start a server and connect once it listens. A rival launcher's server may win the
        pool's lock (ours then exits 0): its socket serves as well."""
        proc = self._spawn(code)
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            try:
                return self._connect()
            except OSError:
                pass
            if proc.poll() not in (None, 0):
                raise PoolUnavailable(f"the pool's server exited with status {proc.returncode} "
                                      f"before it listened: {self._log_tail()}")
            time.sleep(POLL_S)
        raise PoolUnavailable(f"the pool's server did not listen on {self.paths.socket} within "
                              f"{self.settings.start_timeout_s:g}s (it goes on loading for the "
                              f"next run; raise start_timeout_seconds on a busy machine); "
                              f"its log: {self._log_tail()}")

    def _spawn(self, code: RunCode) -> subprocess.Popen:
        try:
            # Private: the runs' logs and the socket that starts runs are this user's alone.
            self.paths.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.paths.runs.mkdir(mode=0o700, exist_ok=True)
            log = open(self.paths.server_log, "ab")  # noqa: SIM115 - the server owns it
        except OSError as e:
            raise PoolUnavailable(f"cannot create the pool's folder {self.paths.root} ({e}); "
                                  "set the launcher's pool_directory to a writable folder") from e
        argv = [code.executable or sys.executable, "-m", SERVER_MODULE, "--root", str(self.paths.root),
                "--module", code.module, "--attribute", code.attribute,
                "--idle-exit-s", str(self.settings.idle_exit_s)]
        if code.working_directory:
            argv += ["--working-directory", code.working_directory]
        if self.settings.exit_with_launcher:
            argv += ["--parent-pid", str(os.getpid())]
        for path in self.settings.watch:
            argv += ["--watch", str(path)]
        with log:
            try:  # its own session: a signal to the launcher's group never reaches it
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                        cwd=code.working_directory or None,
                                        start_new_session=True)
            except OSError as e:
                raise PoolUnavailable(f"cannot start the pool's server ({e})") from e
        self._servers.append(proc)
        return proc

    def _reap(self) -> None:
        """Servers this process started that exited since (they are its children)."""
        self._servers = [p for p in self._servers if p.poll() is None]

    def _log_tail(self, chars: int = 1500) -> str:
        try:
            return self.paths.server_log.read_text(errors="replace")[-chars:].strip() or "(empty)"
        except OSError:
            return "(no log)"


GO = b"go\n"  # the launcher to its forked run worker: run the run (RunPool._ask)


def read_line(conn: socket.socket) -> bytes:
    """One newline-terminated line from `conn` (ValueError if it closes first)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = conn.recv(65536)
        if not chunk:
            raise ValueError("the connection closed before a whole line came")
        chunks.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n") or b"\n" in chunk:
            return b"".join(chunks).split(b"\n", 1)[0]
        if size > LINE_LIMIT:
            raise ValueError(f"a line longer than {LINE_LIMIT} bytes")
