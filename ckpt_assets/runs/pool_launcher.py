"""`PoolRunLauncher`: Dagster's default run launcher, but each run's worker is forked from
a warm server (the run pool) instead of started as a fresh interpreter.

In dagster.yaml (the embedded default instance's launcher; see docs/dagster.md, "A warm
pool of run workers"):

    run_launcher:
      module: ckpt_assets.runs.pool_launcher
      class: PoolRunLauncher
      config:                       # all optional
        pool_directory: /some/dir   # default: run_pool/ in the instance folder
        start_timeout_seconds: 30   # wait for a server being started, else start cold
        reply_timeout_seconds: 5    # a server that answers nothing within this is broken
        idle_exit_seconds: 3600     # the server exits after this long without a run
        exit_with_launcher: true    # ... and when the process that started it exits
        watch_paths: []             # more code whose change restarts the server

Fail safe: where the pool cannot take a run (no server could be started or reached, it
answered nothing in time, refused, or the run's code is not a module code location), the
run is launched as the default launcher launches it (a fresh run worker under the code
server) and an engine event on the run says why. A run is never lost to the pool.

Termination: a pooled run worker's pid and start time are recorded in the pool's folder;
`terminate` marks the run canceling and sends the worker SIGINT, as the code server's
cancel does for its run workers (`dagster_shared.ipc.send_interrupt`), so the run ends
CANCELED the same way. A cold run is terminated through its code server, as before.

Health checks: none, as with the default launcher (`supports_check_run_worker_health`
stays False): run monitoring treats pooled and cold runs alike. A run whose worker died is
failed by the fork server that reaped it, as the code server fails a cold run's
(`fork_server.report_worker_exit`); one whose server was gone too is found by the project's
own readers (`ckpt_assets.lifecycle.lost_worker`).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import dagster as dg

from ckpt_assets.attempt.process_group import ProcessRef
from ckpt_assets.runs.dagster_private import (
    execute_run_args,
    remember_launched_run,
    report_engine_event,
    run_code,
)
from ckpt_assets.runs.names import TRAINING_JOB_NAMES
from ckpt_assets.runs.run_pool import Forked, PoolPaths, PoolSettings, PoolUnavailable, RunPool

POOL_FOLDER = "run_pool"  # in the instance folder, unless pool_directory says otherwise


class PoolRunLauncher(dg.DefaultRunLauncher):
    def __init__(self, inst_data=None, pool_directory: str | None = None,
                 start_timeout_seconds: float = 30.0, reply_timeout_seconds: float = 5.0,
                 idle_exit_seconds: float = 3600.0, watch_paths: list[str] | None = None,
                 exit_with_launcher: bool = True):
        super().__init__(inst_data=inst_data)
        self._pool_directory = pool_directory
        self._settings = PoolSettings(
            start_timeout_s=float(start_timeout_seconds),
            reply_timeout_s=float(reply_timeout_seconds),
            idle_exit_s=float(idle_exit_seconds),
            # Absolute here: the server resolves them elsewhere.
            watch=tuple(str(Path(p).resolve()) for p in watch_paths or ()),
            exit_with_launcher=bool(exit_with_launcher))
        self._pool: RunPool | None = None

    @classmethod
    def config_type(cls):
        return {
            "pool_directory": dg.Field(dg.StringSource, is_required=False),
            "start_timeout_seconds": dg.Field(float, is_required=False, default_value=30.0),
            "reply_timeout_seconds": dg.Field(float, is_required=False, default_value=5.0),
            "idle_exit_seconds": dg.Field(float, is_required=False, default_value=3600.0),
            "watch_paths": dg.Field([str], is_required=False, default_value=[]),
            "exit_with_launcher": dg.Field(bool, is_required=False, default_value=True),
        }

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        return cls(inst_data=inst_data, **config_value)

    def paths(self) -> PoolPaths:
        root = self._pool_directory or Path(self._instance.root_directory) / POOL_FOLDER
        return PoolPaths(Path(root))

    def launch_run(self, context) -> None:
        run = context.dagster_run
        try:
            forked = self._fork(run)
        except Exception as e:  # noqa: BLE001 - a fault of the pool must never lose the run
            # Safe to start cold: a forked worker runs only once `_fork` has told it GO, its
            # last act, so whatever raised here, no worker runs this run.
            why = str(e) if isinstance(e, PoolUnavailable) else f"{type(e).__name__}: {e}"
            report_engine_event(self._instance, run,
                                f"The run pool cannot start this run ({why}); starting it cold "
                                "through the code server, as the default launcher does.",
                                {"pool_directory": str(self.paths().root)})
            super().launch_run(context)
            return
        try:  # what terminate() needs; the run runs whether or not it could be written
            self.paths().run_record(run.run_id).write_text(json.dumps(
                {"pid": forked.pid, "start": forked.start, "server_pid": forked.server_pid}))
        except OSError as e:
            report_engine_event(self._instance, run, f"The run pool could not record run "
                                f"worker {forked.pid} ({e}): terminate it by its pid.",
                                {"pid": forked.pid})
        report_engine_event(self._instance, run,
                            f"Run worker {forked.pid} forked from the run pool's server "
                            f"{forked.server_pid}; its output goes to {forked.log}.",
                            {"pid": forked.pid, "server_pid": forked.server_pid,
                             "log": forked.log})
        remember_launched_run(self, run.run_id)

    def _fork(self, run: dg.DagsterRun) -> Forked:
        code = run_code(run)
        if code is None:
            raise PoolUnavailable("the run's code is not loaded from a module; the pool "
                                  "serves module code locations only")
        if self._pool is None or self._pool.paths != self.paths():
            self._pool = RunPool(self.paths(), self._settings)
        return self._pool.fork_run(run.run_id, code, execute_run_args(run, self._instance),
                                   trains=run.job_name in TRAINING_JOB_NAMES)

    def pooled_worker(self, run_id: str) -> ProcessRef | None:
        """The run worker the pool forked for `run_id`, or None (a cold run, or none)."""
        try:
            raw = json.loads(self.paths().run_record(run_id).read_text())
        except (OSError, ValueError):
            return None
        return ProcessRef(int(raw["pid"]), int(raw["start"]))

    def terminate(self, run_id: str) -> bool:
        worker = self.pooled_worker(run_id)
        if worker is None:
            return super().terminate(run_id)
        run = self._instance.get_run_by_id(run_id)
        if run is None or run.is_finished:
            return False
        self._instance.report_run_canceling(run)
        if not worker.alive():
            report_engine_event(self._instance, run,
                                f"The run's pooled run worker (pid {worker.pid}) is gone; "
                                "nothing to interrupt (run monitoring ends the cancel).",
                                {"pid": worker.pid})
            return False
        try:  # the interrupt the code server's cancel sends its run workers
            os.kill(worker.pid, signal.SIGINT)
        except ProcessLookupError:
            return False
        return True
