"""A real dagster-daemon on a temporary instance, and the faults a cluster injects.

Used by the end-to-end auto-resume tests and by benchmarks/bench_resume_latency.py and
benchmarks/bench_goodput.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_assets.lifecycle.settings import Setting
from tests.dagster_fixtures import MLFLOW_DB, stop_process_group, with_migrated_mlflow_db
from tests.polling import wait_for
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ACTIVE = ("STARTING", "STARTED", "CANCELING")
EMBEDDED_INSTANCE_YAML = ROOT / "dagster_home" / "dagster.yaml"
LOCATION = "ckpt_assets"  # the code location's name in workspace.yaml and pyproject.toml
PROJECT_WORKSPACE = ROOT / "workspace.yaml"  # the embedded default's: the daemon's code server


def training_config(run: str, **overrides) -> dict:
    cfg = {"run": run, "max_steps": 60, "eval_every": 20, "batch_size": 32,
           "checkpoint": {"every_steps": 10, "keep_last": 3, "heartbeat_seconds": 0},
           "task_args": {"n_train": 512, "n_eval": 128, "hidden": 32, "step_delay": 0.1}}
    for k, v in overrides.items():
        cfg[k] = {**cfg[k], **v} if isinstance(v, dict) and isinstance(cfg.get(k), dict) else v
    return cfg


def baseline_config() -> dict:
    """`training_config("base")` without its step delay: what the resumed runs of the
    end-to-end tests must end equal to (the `uninterrupted` fixture)."""
    cfg = training_config("base")
    cfg["task_args"].pop("step_delay")
    return cfg


def fresh_instance(workdir: Path, store: str, extra_env: dict | None = None,
                   instance_yaml: Path = EMBEDDED_INSTANCE_YAML):
    """(home, env, instance): a new DAGSTER_HOME under `workdir` with `instance_yaml` (the
    project's embedded dagster.yaml unless told otherwise), and the environment its
    processes run with."""
    from dagster import DagsterInstance
    from dagster._core.instance.ref import InstanceRef

    home = workdir / "dagster_home"
    home.mkdir(parents=True)
    shutil.copy(instance_yaml, home / "dagster.yaml")
    with_migrated_mlflow_db(home)
    # A short back-off, so that a test's backed-off resume comes within seconds.
    env = {**os.environ, "DAGSTER_HOME": str(home), "CKPT_STORE_URI": store,
           "MLFLOW_TRACKING_URI": f"sqlite:///{home / MLFLOW_DB}",
           "PYTHONPATH": str(ROOT), Setting.BACKOFF_BASE_S.value: "2", **(extra_env or {})}
    # Create the storage once, here: processes that create it concurrently race on its
    # schema version table. The instance file's `env:` settings resolve from the same
    # environment the daemon gets.
    with _environ(extra_env or {}):
        instance = DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))
    instance.get_runs(limit=1)
    return home, env, instance


@contextlib.contextmanager
def _environ(overrides: dict):
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _start_code_server(workdir: Path, env: dict) -> tuple[subprocess.Popen, Path]:
    """`dagster api grpc` serving the project's code location on a free loopback port, once
    it has loaded the definitions; and a workspace file that points at it."""
    port, log_path = free_port(), workdir / "code-server.log"
    proc = subprocess.Popen(
        [str(BIN / "dagster"), "api", "grpc", "-m", "ckpt_assets.definitions", "-a", "defs",
         "--location-name", LOCATION, "-h", "127.0.0.1", "-p", str(port), "-d", str(ROOT)],
        cwd=ROOT, env=env, start_new_session=True, stdout=open(log_path, "w"),
        stderr=subprocess.STDOUT)
    wait_for(lambda: proc.poll() is not None or "Started Dagster code server" in
             log_path.read_text(), 300, what="the code server to load the definitions")
    assert proc.poll() is None, log_path.read_text()[-3000:]
    workspace = workdir / "workspace.yaml"
    workspace.write_text(f"load_from:\n  - grpc_server:\n      host: 127.0.0.1\n"
                         f"      port: {port}\n      location_name: {LOCATION}\n")
    return proc, workspace


@dataclass
class Daemon:
    home: Path
    store: str
    env: dict
    proc: subprocess.Popen
    log_path: Path
    workspace: Path = PROJECT_WORKSPACE  # what the daemon (and `dagster` commands) load
    code_server: subprocess.Popen | None = None
    max_active: dict = field(default_factory=lambda: defaultdict(int))
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def instance(self):
        from dagster import DagsterInstance
        from dagster._core.instance.ref import InstanceRef

        if not hasattr(self, "_instance"):
            self._instance = DagsterInstance.from_ref(InstanceRef.from_dir(str(self.home)))
        return self._instance

    # -- lifecycle ------------------------------------------------------------------------
    @classmethod
    def start(cls, workdir: Path, store: str, extra_env: dict | None = None,
              instance_yaml: Path = EMBEDDED_INSTANCE_YAML,
              workspace: Path | None = None) -> Daemon:
        """A daemon on a fresh instance. Without `workspace`, the code location is served by
        a code server of the daemon's own, started first with the daemon's environment (a
        `grpc_server` workspace, as a team deployment runs one): given the project's
        python_module workspace, a daemon replaces its code server every minute (Dagster's
        RELOAD_WORKSPACE_INTERVAL), a process loading the definitions again each time. The
        benchmarks pass PROJECT_WORKSPACE: they measure the embedded default's path."""
        home, env, instance = fresh_instance(workdir, store, extra_env, instance_yaml)
        server = None
        if workspace is None:
            server, workspace = _start_code_server(workdir, env)
        log_path = workdir / "daemon.log"
        proc = subprocess.Popen([str(BIN / "dagster-daemon"), "run", "-w", str(workspace)],
                                cwd=ROOT, env=env, start_new_session=True,
                                stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
        d = cls(home, store, env, proc, log_path, workspace=workspace, code_server=server)
        d._instance = instance
        threading.Thread(target=d._watch_active, daemon=True).start()
        return d

    def stop(self) -> None:
        self._stop.set()
        stop_process_group(self.proc, 60)
        if self.code_server is not None:
            stop_process_group(self.code_server, 60)
        # Runs launched by the daemon live in their own sessions: end any left over.
        for run in self.instance.get_runs():
            if run.status.value in ACTIVE:
                hb = self.heartbeat(run.tags.get("dagster/partition", ""))
                if hb and hb.get("pid"):
                    _kill(int(hb["pid"]), signal.SIGKILL)

    def _watch_active(self) -> None:
        import dagster as dg

        active = dg.RunsFilter(statuses=[dg.DagsterRunStatus(s) for s in ACTIVE])
        while not self._stop.is_set():
            try:
                counts: dict[str, int] = defaultdict(int)
                # Only the active runs are read, twice a second: a second writer's run
                # would be active for seconds (its start alone takes that long), and a whole
                # history's records read more often would cost the suite more CPU than the
                # runs it watches.
                for run in self.instance.get_runs(filters=active):
                    counts[run.tags.get("dagster/partition", "")] += 1
                for k, n in counts.items():
                    self.max_active[k] = max(self.max_active[k], n)
            except Exception:
                pass
            time.sleep(0.5)

    # -- actions --------------------------------------------------------------------------
    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ckpt_assets", *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def launch(self, run: str, config: dict, workdir: Path) -> None:
        path = workdir / f"{run}.json"
        path.write_text(json.dumps(config))
        res = self.cli("launch", run, "--config", str(path))
        assert res.returncode == 0, res.stdout + res.stderr

    def dagster(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "dagster"), *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=300)

    # -- observation ----------------------------------------------------------------------
    def outcome_names(self, partition: str, run_id: str, attempt: int) -> dict[str, str | None]:
        """`tests.outcome_views.outcome_names` on this daemon's instance, store and MLflow."""
        from tests.outcome_views import outcome_names

        return outcome_names(self.instance, self.store, self.env["MLFLOW_TRACKING_URI"],
                             partition, run_id, attempt)

    def runs(self, partition: str) -> list:
        """The partition's training runs, oldest first (its check runs left out)."""
        from ckpt_assets.base.queries import training_runs_of

        return list(reversed(training_runs_of(self.instance, partition)))

    def heartbeat(self, run: str, experiment: str = "default") -> dict | None:
        from trainer.checkpoints.repo import CheckpointRepo
        from trainer.storage import open_store

        try:
            if not hasattr(self, "_store"):  # one client: an S3 client costs milliseconds
                self._store = open_store(self.store)
            return CheckpointRepo(self._store, experiment, run).read_heartbeat()
        except Exception:
            return None

    def wait_for_step(self, run: str, step: int, attempt: int, timeout: float = 420) -> dict:
        def reached():
            hb = self.heartbeat(run)
            return hb if hb and hb.get("attempt") == attempt and hb.get("step", 0) >= step \
                else None

        return wait_for(reached, timeout, 0.1, f"{run}: attempt {attempt} to reach step {step}",
                        lambda: self.state_of(run))

    def state_of(self, run: str) -> str:
        """What a failed wait on `run` prints: its runs with their ckpt tags, its heartbeat,
        the sensors whose evaluation is in flight, and the daemon log's tail."""
        lines = [f"heartbeat: {self.heartbeat(run)}"]
        for r in self.runs(run):
            ours = {k: v for k, v in r.tags.items() if k.startswith("ckpt/")}
            lines.append(f"run {r.run_id[:8]} {r.status.value} {ours}")
        from dagster._core.scheduler.instigation import InstigatorType

        busy = [s.instigator_name for s in self.instance.all_instigator_state(
            instigator_type=InstigatorType.SENSOR) if self.tick_in_flight(s.instigator_name)]
        lines.append(f"sensors evaluating now: {busy}")
        return "\n".join(lines) + "\n" + self.log_tail(120)

    def _failure_events(self, run_id: str) -> list:
        from dagster import DagsterEventType

        kinds = {DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE}
        return [e.dagster_event for e in self.instance.all_logs(run_id)
                if e.is_dagster_event and e.dagster_event.event_type in kinds]

    def failures_of(self, run: str) -> str:
        """Why each failed run of the partition failed, as its failure events say."""
        def why(e) -> str:
            data = e.step_failure_data if e.is_step_failure else None
            told = data and (data.user_failure_data and data.user_failure_data.description
                             or data.error and data.error.message)
            return f"{e.message} {told or ''}".strip()

        return "\n".join(f"run {r.run_id[:8]} {e.event_type.value}: {why(e)}"
                         for r in self.runs(run) for e in self._failure_events(r.run_id))

    def start_timed_out(self, run_id: str) -> bool:
        """Whether Dagster's run monitoring failed run `run_id` for starting too late."""
        from dagster._core.events import DagsterEventType, RunFailureReason

        return any(e.event_type == DagsterEventType.RUN_FAILURE and e.job_failure_data
                   and e.job_failure_data.failure_reason == RunFailureReason.START_TIMEOUT
                   for e in self._failure_events(run_id))

    def wait_until(self, pred, what: str, timeout: float = 300, every: float = 0.5,
                   run: str | None = None):
        return wait_for(pred, timeout, every, what,
                        (lambda: self.state_of(run)) if run else self.log_tail)

    def wait_done(self, run: str, timeout: float = 400) -> object:
        """Wait until the newest run of the partition succeeded and nothing is queued."""
        def done():
            runs = self.runs(run)
            if runs and runs[-1].status.value == "SUCCESS":
                return runs[-1]
            return None
        return self.wait_until(done, f"{run} to finish successfully", timeout, run=run)

    def sensor_ticks(self, name: str, after: float) -> list:
        """Finished evaluations of sensor `name` that started after `after` (epoch seconds)."""
        from dagster._core.scheduler.instigation import InstigatorType, TickStatus

        done = [TickStatus.SUCCESS, TickStatus.SKIPPED, TickStatus.FAILURE]
        ticks = []
        for state in self.instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
            if state.instigator_name == name:
                ticks += self.instance.get_ticks(state.instigator_origin_id, state.selector_id,
                                                 after=after, statuses=done)
        return ticks

    def tick_in_flight(self, name: str) -> bool:
        """Whether an evaluation of sensor `name` has started and not yet finished."""
        from dagster._core.scheduler.instigation import InstigatorType, TickStatus

        return any(
            self.instance.get_ticks(state.instigator_origin_id, state.selector_id,
                                    statuses=[TickStatus.STARTED])
            for state in self.instance.all_instigator_state(instigator_type=InstigatorType.SENSOR)
            if state.instigator_name == name)

    def wait_for_ticks(self, counts: dict[str, int], timeout: float = 300) -> None:
        """Return once each named sensor has finished `counts[name]` more evaluations from
        now. A tick that raised, or a deadline that passes, fails the test: "nothing happened"
        is only evidence once the sensors have demonstrably looked."""
        from dagster._core.scheduler.instigation import TickStatus

        since = time.time()

        def finished() -> dict[str, int] | None:
            ticks = {name: self.sensor_ticks(name, since) for name in counts}
            failed = [f"{name}: {t.error.message if t.error else '?'}"
                      for name, ts in ticks.items() for t in ts if t.status == TickStatus.FAILURE]
            if failed:
                raise AssertionError("sensor ticks failed: " + "; ".join(failed) + "\n"
                                     + self.log_tail())
            seen = {name: len(ts) for name, ts in ticks.items()}
            return seen if all(seen[name] >= n for name, n in counts.items()) else None

        wait_for(finished, timeout, 0.5, f"sensor ticks {counts}", self.log_tail)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""


def trainer_parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def kill(pid: int, sig: int) -> None:
    _kill(pid, sig)


@contextlib.contextmanager
def held(pid: int):
    """Process `pid` stopped (SIGSTOP) for the block, continued (SIGCONT) however it ends."""
    kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        kill(pid, signal.SIGCONT)
