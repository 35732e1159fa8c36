"""SIGKILL the trainer at random moments inside the save window, many times over.

Each trial forks a trainer process (from a parent that has imported torch but never run
it, so the fork is cheap and safe), waits until that process starts saving a
checkpoint, sleeps a random fraction of a save and kills it with SIGKILL. After each kill
the run's newest checkpoint must verify (manifest hashes) and must be at least as new
as the last commit the trainer reported, so at most one save interval of work is lost.
The next trial resumes from it, which proves it also loads.

    python benchmarks/soak_crash_during_save.py --trials 1000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import select
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import cli, loop  # noqa: E402,F401  (loop imports torch here, once, before any fork)
from trainer.checkpoints.repo import CheckpointRepo  # noqa: E402
from trainer.storage import open_store  # noqa: E402

SAVE_RE = re.compile(rb"saving step (\d+)")
COMMIT_RE = re.compile(rb"checkpoint committed: step (\d+) .*\(\d+ bytes, ([0-9.]+)s\)")
RESUMED_RE = re.compile(rb"resumed from \S+ at step (\d+)")


def fork_trainer(argv: list[str]) -> tuple[int, int]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: become the trainer
        os.close(r)
        os.dup2(w, 1)
        os.dup2(w, 2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            code = cli.main(argv)
        except BaseException:
            code = 1
        os._exit(code)
    os.close(w)
    return pid, r


def trial(config: Path, store: str, rng: random.Random, save_s: float) -> dict:
    pid, fd = fork_trainer(["--config", str(config), "--store", store, "--log-level", "DEBUG"])
    buf = b""
    committed: list[int] = []
    resumed = None
    killed_during = None
    saves_seen = 0
    target_save = rng.randint(1, 3)  # not always the first save of the attempt
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        for m in COMMIT_RE.finditer(buf):
            committed.append(int(m.group(1)))
            save_s = max(save_s * 0.9, float(m.group(2)))
        if resumed is None and (m := RESUMED_RE.search(buf)):
            resumed = int(m.group(1))
        saves = SAVE_RE.findall(buf)
        buf = buf[buf.rfind(b"\n") + 1:] if COMMIT_RE.search(buf) is None else buf[-200:]
        saves_seen += len(saves)
        if saves_seen >= target_save and killed_during is None:
            time.sleep(rng.uniform(0, save_s * 1.2))
            killed_during = int(saves[-1]) if saves else None
            os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(fd)
    return {"committed_seen": committed, "resumed_from": resumed, "killed_in_save_of": killed_during,
            "save_s": save_s}


def run(trials: int, seed: int, workdir: Path) -> dict:
    rng = random.Random(seed)
    store = str(workdir / "store")
    cfg = workdir / "cfg.json"
    cfg.write_text(json.dumps({
        "run": "soak", "max_steps": 10_000_000, "eval_every": 0,
        "checkpoint": {"every_steps": 2, "keep_last": 2, "on_epoch_end": False,
                       "on_best": False, "heartbeat_seconds": 60},
        "task_args": {"hidden": 384, "n_train": 512, "n_eval": 64},
    }))
    repo = CheckpointRepo(open_store(store), "default", "soak")
    failures = []
    last_step = None
    save_s = 0.02
    for i in range(trials):
        t = trial(cfg, store, rng, save_s)
        save_s = t["save_s"]
        manifest, skipped = repo.find_latest_valid()
        problems = []
        if manifest is None:
            problems.append("no checkpoint verifies")
        if skipped:
            problems.append(f"walk-back was needed: {skipped}")
        if last_step is not None and t["resumed_from"] != last_step:
            problems.append(f"resumed from {t['resumed_from']}, expected {last_step}")
        if manifest is not None and t["committed_seen"] and manifest.step < t["committed_seen"][-1]:
            problems.append(f"newest valid step {manifest.step} is older than the last commit "
                            f"reported ({t['committed_seen'][-1]}): committed work was lost")
        if problems:
            failures.append({"trial": i, **t, "problems": problems})
        last_step = manifest.step if manifest else None
        if (i + 1) % 100 == 0:
            print(f"  {i + 1} kills, {len(failures)} failures, newest step {last_step}",
                  file=sys.stderr, flush=True)
    return {"trials": trials, "failures": len(failures), "details": failures[:5],
            "final_step": last_step}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        out = run(args.trials, args.seed, Path(d))
        out["seconds"] = round(time.monotonic() - t0, 1)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"crash-during-save soak: {out['trials']} SIGKILLs inside the save window, "
              f"{out['trials'] - out['failures']} resumed from a verified checkpoint with no "
              f"committed work lost, {out['failures']} failures ({out['seconds']} s)")
        for f in out["details"]:
            print("  failure:", f)
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
