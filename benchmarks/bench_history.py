"""An instance that keeps its history: the sensors, the reconciler and `list` at 1,000 and
10,000 training runs, side by side with Dagster's own query floors.

The instance is the project's embedded one (its dagster.yaml: SQLite), grown through
Dagster's public API as a year of training leaves it: each training run registered in a
local store with one committed checkpoint, and, by turns, preempted or terminated once
(a failed or canceled run decided `resume`, its decision record in the store, and the
resume that finished it), stopped by the policy (decided `stop`), or finished at once:
about 1.8 Dagster runs per training run. The history runs are added with their final
status (`DagsterInstance.add_run`), as their records hold them; the failures the sensors
decide are reported through `report_run_failed`, as a run worker reports them.

Measured, each the median of --repeats evaluations, in this process:

- the three run-status sensors (`resume_failed_training`, `resume_terminated_training`,
  `check_succeeded_training`) through `evaluate_tick` with the context the daemon builds
  (definitions, instance, cursor): a tick with nothing new, and a tick that decides a
  failure;
- `reconcile_training_runs`: the first evaluation (no cursor: the whole history once), its
  full sweep and its tick with nothing to do, with the run-storage calls each makes;
- `ckpt-assets list` (default, and `--all` at the smaller size): in-process, and as a
  command, next to the command's start-up alone (`list --help`);
- the floors: Dagster's own queries on the same instance (the newest run; the failed or
  canceled runs updated in the last two minutes, which is what a tick and a sweep ask; the
  200 newest failed or canceled runs, which the reconciler read before; the partitions).

The history's update times are those of the build: before measuring the steady sweep and
tick, the benchmark waits out the reconciler's window overlap (OVERLAP_S, 120 s) once per
size, so that they see an instance whose history ended before their last look.

    python benchmarks/bench_history.py [--sizes 1000 10000] [--repeats 7] [--dir DIR]

--dir: where the instance and the store are built (default: a temporary folder; a folder
on tmpfs, /dev/shm, builds 10,000 runs in minutes on a slow disk; the figures printed say
which).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dagster as dg  # noqa: E402
from history_instance import add_training_run, commit_checkpoint, grow, new_instance  # noqa: E402

from ckpt_assets.base.names import PARTITIONS_NAME  # noqa: E402
from ckpt_assets.base.registration import register_training_run  # noqa: E402
from ckpt_assets.base.tags import (  # noqa: E402
    PARTITION_TAG,
    TAG_DECISION,
    TAG_PARENT_RUN_ID,
    TAG_RESUMED_BY,
)
from ckpt_assets.lifecycle.pending import OVERLAP_S  # noqa: E402

S = dg.DagsterRunStatus
COUNTED = ("get_runs", "get_run_records", "get_run_ids", "get_run_by_id",
           "get_run_record_by_id", "get_run_tags", "get_runs_count",
           "fetch_run_status_changes", "get_records_for_run", "all_logs",
           "get_dynamic_partitions", "get_daemon_heartbeats")
TARGETS = {"reconciler sweep": (0.050, 5), "reconciler tick": (0.010, None),
           "list (default)": (1.0, None)}


class Calls:
    """The instance's storage reads made inside a `with`, by name."""

    def __init__(self, instance):
        self.instance, self.made = instance, []

    def __enter__(self):
        for name in COUNTED:
            real = getattr(self.instance, name)

            def counted(*a, _real=real, _name=name, **k):
                self.made.append(_name)
                return _real(*a, **k)

            setattr(self.instance, name, counted)
        return self

    def __exit__(self, *exc):
        for name in COUNTED:
            delattr(self.instance, name)


def median_s(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def floors(instance, repeats: int) -> dict[str, float]:
    from datetime import UTC, datetime

    ended = [S.FAILURE, S.CANCELED]
    recent = datetime.fromtimestamp(time.time() - OVERLAP_S, UTC)
    return {
        "get_runs(limit=1)": median_s(lambda: instance.get_runs(limit=1), repeats),
        "get_runs(failed/canceled, updated in the last 120 s)": median_s(
            lambda: instance.get_runs(filters=dg.RunsFilter(statuses=ended,
                                                            updated_after=recent)), repeats),
        "get_run_records(failed/canceled, limit=200)": median_s(
            lambda: instance.get_run_records(filters=dg.RunsFilter(statuses=ended), limit=200),
            repeats),
        "get_dynamic_partitions(training_runs)": median_s(
            lambda: instance.get_dynamic_partitions(PARTITIONS_NAME), repeats),
    }


def _sensor_tick(sensor, instance, cs, cursor):
    from ckpt_assets.definitions import defs

    return sensor.evaluate_tick(dg.build_sensor_context(
        instance=instance, cursor=cursor, definitions=defs,
        resources={"checkpoint_store": cs}))


def sensors(instance, cs, repeats: int) -> dict[str, float]:
    """Each run-status sensor's tick with nothing new, and the failure sensors' tick that
    decides one failure (a new run of a registered training run, reported failed or
    canceled the way a run worker reports it; the report itself is not timed)."""
    from ckpt_assets.defs.check_runs import check_succeeded_training
    from ckpt_assets.defs.sensors import resume_failed_training, resume_terminated_training

    out, store = {}, cs.open()
    for sensor in (resume_failed_training, resume_terminated_training,
                   check_succeeded_training):
        cursor = _sensor_tick(sensor, instance, cs, None).cursor  # starts at the newest event
        out[f"{sensor.name}: idle tick"] = median_s(
            lambda s=sensor, c=cursor: _sensor_tick(s, instance, cs, c), repeats)
    for sensor, report in ((resume_failed_training, instance.report_run_failed),
                           (resume_terminated_training, instance.report_run_canceled)):
        times = []
        for _ in range(max(3, repeats // 2)):
            cursor = _sensor_tick(sensor, instance, cs, None).cursor
            key = f"fresh-{uuid.uuid4().hex[:8]}"
            register_training_run(store, key, {"max_steps": 100})
            commit_checkpoint(store, key)
            instance.add_dynamic_partitions(PARTITIONS_NAME, [key])
            report(add_training_run(instance, key, S.STARTED, {}), "ended for the benchmark")
            t = time.perf_counter()
            res = _sensor_tick(sensor, instance, cs, cursor)
            times.append(time.perf_counter() - t)
            assert "decided" in (res.skip_message or ""), res.skip_message
        out[f"{sensor.name}: tick deciding one failure"] = statistics.median(times)
    return out


def _reconcile(instance, cs, cursor: str | None):
    from ckpt_assets.defs.sensors import reconcile_training_runs

    ctx = dg.build_sensor_context(instance=instance, cursor=cursor,
                                  resources={"checkpoint_store": cs})
    out = reconcile_training_runs(ctx)
    assert isinstance(out, dg.SkipReason), f"nothing to launch expected, got {out}"
    return ctx.cursor


def reconciler_first(instance, cs) -> tuple[float, int, str]:
    """The first evaluation (no cursor): one read of the whole history."""
    with Calls(instance) as calls:
        t = time.perf_counter()
        cursor = _reconcile(instance, cs, None)
        took = time.perf_counter() - t
    return took, len(calls.made), cursor


def reconciler_steady(instance, cs, cursor: str, repeats: int) -> dict[str, tuple]:
    """The full sweep and the tick, with a cursor whose windows began after the history."""
    from dataclasses import replace

    from ckpt_assets.defs.sensors import RECONCILE_EVERY_S
    from ckpt_assets.lifecycle.pending import Cursor

    base = Cursor.parse(_reconcile(instance, cs, cursor))  # the look that moves the windows
    out = {}
    for name, swept_ago in (("reconciler sweep", RECONCILE_EVERY_S + 1),
                            ("reconciler tick", 0.0)):
        def look(ago=swept_ago):
            return _reconcile(instance, cs, replace(base, swept_at=time.time() - ago).dump())

        with Calls(instance) as calls:
            look()
        out[name] = (median_s(look, repeats), calls.made)
    return out


def list_figures(home: Path, cs, all_too: bool, repeats: int) -> dict[str, tuple]:
    from ckpt_assets.cli.main import main as cli

    out = {}
    for name, argv in (("list (default)", ["list"]), *((("list --all", ["list", "--all"]),)
                                                        if all_too else ())):
        lines: list[str] = []

        def once(argv=argv, lines=lines):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert cli([*argv, "--store", cs.uri]) == 0
            lines[:] = buf.getvalue().splitlines()

        took = median_s(once, repeats if name == "list (default)" else 1)
        out[name] = (took, len(lines), lines)
    env = {**os.environ, "DAGSTER_HOME": str(home), "PYTHONPATH": str(ROOT)}

    def wall(*args: str) -> float:
        t = time.perf_counter()
        subprocess.run([sys.executable, *args], env=env, cwd=ROOT, check=True,
                       capture_output=True)
        return time.perf_counter() - t

    out["command: start-up (interpreter + imports)"] = (
        statistics.median(wall("-c", "import dagster, ckpt_assets.cli.list_runs")
                          for _ in range(3)), None, None)
    out["command: ckpt-assets list"] = (statistics.median(
        wall("-m", "ckpt_assets", "list", "--store", cs.uri) for _ in range(3)), None, None)
    return out


def close_fresh(instance) -> None:
    """The resumes of the failures the sensors decided here, launched and finished: the
    history stays one with nothing for the reconciler to do."""
    for run in instance.get_runs(filters=dg.RunsFilter(tags={TAG_DECISION: "resume"},
                                                       statuses=[S.FAILURE, S.CANCELED]),
                                 limit=50):
        key = run.tags[PARTITION_TAG]
        if key.startswith("fresh-") and TAG_RESUMED_BY not in run.tags:
            nxt = add_training_run(instance, key, S.SUCCESS, {TAG_PARENT_RUN_ID: run.run_id})
            instance.add_run_tags(run.run_id, {TAG_RESUMED_BY: nxt.run_id})


def measure(instance, cs, home: Path, size: int, built_at: float, repeats: int) -> dict:
    fig: dict = {"runs": instance.get_runs_count()}
    fig["first"] = reconciler_first(instance, cs)
    fig["list"] = list_figures(home, cs, size <= 1000, repeats)
    quiet = built_at + OVERLAP_S + 2 - time.time()
    if quiet > 0:
        print(f"  ({size}: waiting {quiet:.0f}s for the build to leave the reconciler's "
              "window)", flush=True)
        time.sleep(quiet)
    fig["floors"] = floors(instance, repeats)  # the last two minutes hold no build now
    fig["steady"] = reconciler_steady(instance, cs, fig["first"][2], repeats)
    fig["sensors"] = sensors(instance, cs, repeats)
    close_fresh(instance)
    return fig


def ms(s: float) -> str:
    return f"{s * 1000:8.1f} ms"


def report(figs: dict[int, dict], sizes: list[int]) -> None:
    w = 58

    def row(label: str, cells: list[str], note: str = "") -> None:
        print(f"{label:<{w}}" + "".join(f"{c:>22}" for c in cells) + (f"   {note}" if note else ""))

    row("training runs", [f"{n:,}" for n in sizes])
    row("Dagster runs", [f"{figs[n]['runs']:,}" for n in sizes])
    for name in figs[sizes[0]]["floors"]:
        row(f"floor: {name}", [ms(figs[n]["floors"][name]) for n in sizes])
    for name in figs[sizes[0]]["sensors"]:
        row(name, [ms(figs[n]["sensors"][name]) for n in sizes])
    window = "get_runs(failed/canceled, updated in the last 120 s)"
    for name, (limit_s, calls_max) in TARGETS.items():
        if name not in figs[sizes[0]]["steady"]:
            continue
        cells, met = [], True
        for n in sizes:
            took, calls = figs[n]["steady"][name]
            ratio = took / figs[n]["floors"][window]
            cells.append(f"{ms(took)} {len(calls)} calls {ratio:4.1f}x")
            met &= took <= limit_s and (calls_max is None or len(calls) <= calls_max)
        bound = f"<= {limit_s * 1000:.0f} ms" + (f", <= {calls_max} calls" if calls_max else "")
        row(f"reconcile_training_runs: {name.split()[-1]}, nothing to do", cells,
            f"target {bound}: {'MET' if met else 'NOT MET'}")
    for n in sizes:
        calls = figs[n]["steady"]["reconciler sweep"][1]
        print(f"  sweep's storage calls at {n:,}: {', '.join(calls)}")
    row("reconcile_training_runs: first look (no cursor)",
        [f"{ms(figs[n]['first'][0])} {figs[n]['first'][1]} calls" for n in sizes],
        "once per cursor: reads the whole history")
    startup = "command: start-up (interpreter + imports)"
    cells, met = [], True
    for n in sizes:
        took, lines, _ = figs[n]["list"]["list (default)"]
        cells.append(f"{ms(took)} {lines} lines")
        met &= took <= TARGETS["list (default)"][0]
    row("ckpt-assets list (default), in-process", cells,
        f"target <= 1 s beyond start-up: {'MET' if met else 'NOT MET'}")
    for name in (startup, "command: ckpt-assets list"):
        row(name, [ms(figs[n]["list"][name][0]) for n in sizes])
    for n in sizes:
        if "list --all" in figs[n]["list"]:
            took, lines, _ = figs[n]["list"]["list --all"]
            print(f"  ckpt-assets list --all at {n:,}: {ms(took).strip()}, {lines} lines")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--show-list", action="store_true",
                    help="print the default `list` output at the largest size")
    ap.add_argument("--postgres", action="store_true",
                    help="the team instance (deploy/postgres/dagster.yaml) on a PostgreSQL "
                         "server started here for the run, fsync off, instead of SQLite")
    args = ap.parse_args()
    where = Path(tempfile.mkdtemp(prefix="bench-history-", dir=args.dir))
    with contextlib.ExitStack() as stack:
        server = None
        if args.postgres:
            from tests.ports import free_port
            from tests.postgres_server import running_postgres

            server = stack.enter_context(running_postgres(free_port()))
        stack.callback(shutil.rmtree, where, True)
        run(args, where, server)


def run(args, where: Path, server) -> None:
    os.environ["CKPT_STORE_URI"] = str(where / "store")
    instance, cs, home = new_instance(where, server)
    os.environ["DAGSTER_HOME"] = str(home)
    kind = "PostgreSQL (deploy/postgres/dagster.yaml)" if server else \
        "SQLite (the project's dagster.yaml)"
    print(f"instance: {kind}, and a local store, under "
          f"{where} ({'tmpfs' if str(where).startswith('/dev/shm') else 'disk'}); "
          f"repeats {args.repeats}; load average at start "
          f"{os.getloadavg()[0]:.2f}; {os.cpu_count()} cores", flush=True)
    figs, done = {}, 0
    for size in sorted(args.sizes):
        t = time.perf_counter()
        grow(instance, cs, done, size)
        done = size
        print(f"  grew to {size:,} training runs in {time.perf_counter() - t:.0f}s",
              flush=True)
        figs[size] = measure(instance, cs, home, size, time.time(), args.repeats)
    report(figs, sorted(args.sizes))
    if args.show_list:
        took, _, lines = figs[max(args.sizes)]["list"]["list (default)"]
        print(f"\n`ckpt-assets list` at {max(args.sizes):,} training runs "
              f"({ms(took).strip()} in-process):")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
