"""Fixed cost of `ckpt-assets launch`: from starting the command to its Dagster run existing.

Before: the launch that spawned `dagster job launch -w workspace.yaml` (a second process that
loads the workspace and starts a code server), run from that revision's own tree (`git
archive`, default: the last revision whose cli.py did so). After: this tree's launch, which
submits through the instance in-process (ckpt_assets.runs.submit). Both run as real processes
against one temporary DAGSTER_HOME (the project's dagster.yaml: the run queue) and store,
interleaved, each launch a new training run name, in two cases: the first launch (with
--config: it registers the run, and validating the config imports torch) and the launch of
a registered run (registered by that tree's `register` beforehand, not timed). The run's
existence is polled from here every 20 ms; "returned" is when the command exited.

    python benchmarks/bench_launch.py [--repeats 3] [--before REV]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import dagster as dg  # noqa: E402

from ckpt_assets.base.tags import PARTITION_TAG  # noqa: E402
from tests.daemon_harness import fresh_instance, training_config  # noqa: E402

POLL_S = 0.02
# The subprocess submission, as cli.py spelled it: the newest commit that changed how often
# it occurs removed it, and that commit's parent is the launch measured as "before".
OLD_SUBMISSION = '"job", "launch"'


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True).stdout


def before_revision() -> str:
    removed = _git("log", "-1", "--format=%H", f"-S{OLD_SUBMISSION}", "--",
                   "ckpt_assets/cli/main.py").decode().strip()
    if not removed:
        raise SystemExit("no revision of ckpt_assets/cli/main.py launches through `dagster job "
                         "launch`; pass --before REV")
    return f"{removed}^"


def export_tree(rev: str, dest: Path) -> Path:
    with tarfile.open(fileobj=BytesIO(_git("archive", "--format=tar", rev))) as tar:
        tar.extractall(dest, filter="data")
    if OLD_SUBMISSION not in (dest / "ckpt_assets" / "cli.py").read_text():
        raise SystemExit(f"revision {rev}'s launch does not spawn `dagster job launch`")
    return dest


def _ckpt(root: Path, env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ckpt_assets", *args], cwd=root,
                            env={**env, "PYTHONPATH": str(root)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def time_launch(root: Path, name: str, config: Path, env: dict, instance: dg.DagsterInstance,
                registered: bool) -> tuple[float, float]:
    """(seconds until the run exists, seconds until the command returned)."""
    if registered:
        reg = _ckpt(root, env, "register", name, "--config", str(config))
        if reg.wait() != 0:
            raise SystemExit(f"register {name} from {root} failed:\n"
                             f"{reg.stdout.read().decode()[-3000:]}")
    start = time.perf_counter()
    proc = _ckpt(root, env, "launch", name, *(() if registered else ("--config", str(config))))
    exists = None
    while exists is None:
        if instance.get_runs(filters=dg.RunsFilter(tags={PARTITION_TAG: name}), limit=1):
            exists = time.perf_counter() - start
        elif proc.poll() is not None:
            raise SystemExit(f"launch of {name} from {root} exited {proc.returncode} without "
                             f"a run:\n{proc.stdout.read().decode()[-3000:]}")
        else:
            time.sleep(POLL_S)
    out = proc.communicate()[0]
    if proc.returncode != 0:
        raise SystemExit(f"launch of {name} from {root} failed:\n{out.decode()[-3000:]}")
    return exists, time.perf_counter() - start


CASES = {"first launch (--config)": False, "launch of a registered run": True}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", default=None, help="revision of the subprocess launch")
    args = ap.parse_args()
    rev = args.before or before_revision()
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        work = Path(tmp)
        roots = {"before": export_tree(rev, work / "before"), "after": ROOT}
        _, env, instance = fresh_instance(work, str(work / "store"))
        config = work / "train.json"
        cfg = training_config("unused")
        del cfg["run"]  # each launch names its own training run
        config.write_text(json.dumps(cfg))
        times = {(case, v): [] for case in CASES for v in roots}
        for i in range(args.repeats):
            for c, (case, registered) in enumerate(CASES.items()):
                order = list(roots) if i % 2 == 0 else list(reversed(roots))
                for variant in order:
                    times[case, variant].append(time_launch(
                        roots[variant], f"{variant}-{c}-{i}", config, env, instance, registered))
        instance.dispose()
    label = {"before": f"before ({_git('rev-parse', '--short', rev).decode().strip()}, "
                       "dagster job launch)", "after": "after (in-process submit)"}
    print(f"ckpt-assets launch -> its Dagster run exists: median of {args.repeats} "
          "(min..max), seconds")
    for case in CASES:
        print(f"{case}:")
        for variant in roots:
            exists, done = zip(*times[case, variant], strict=True)
            print(f"  {label[variant]:<40} run exists {statistics.median(exists):6.2f} "
                  f"({min(exists):.2f}..{max(exists):.2f})   returned "
                  f"{statistics.median(done):6.2f}")
        before, after = (statistics.median(r[0] for r in times[case, v]) for v in roots)
        print(f"  {'after / before':<40} {after / before:.2f} "
              f"({before - after:.2f} s less)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
