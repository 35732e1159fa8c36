"""A seeded mix of protocol faults against the real trainer CLI, over many trials.

Every trial starts a run and SIGKILLs it somewhere after its first checkpoint (so there is
history to lose), then applies one fault and resumes until the run finishes:

    kill          SIGKILL once more, on a step that saves
    ptr-deleted   latest.json removed                 ptr-garbled    latest.json overwritten
    ptr-types     latest.json a JSON object with wrong types
    disk-full     the Nth save's file write gets a real ENOSPC (/dev/full); expect exit 5
    s3-errors     S3 store behind a proxy that answers 503 from step k on; expect exit 5
    race          two trainers of the run started at once asking for the same attempt;
                  expect one to finish (0) and the other to be fenced (6)

It prints a matrix: trials, committed checkpoints lost (verifying before the fault, gone or
failing after; must be 0, keep_last is high so retention drops nothing), runs that ended
bitwise identical to an uninterrupted run, and exits classified other than expected.

    python benchmarks/soak_faults.py --trials 20 --seed 7
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.polling import WaitTimeout, wait_for  # noqa: E402
from tests.trainer_proc import STEP_RE, assert_bitwise_equal, write_config  # noqa: E402
from trainer.checkpointer import load_verified_state  # noqa: E402
from trainer.contract import Env  # noqa: E402
from trainer.errors import CheckpointError  # noqa: E402
from trainer.repo import POINTER, CheckpointRepo  # noqa: E402
from trainer.storage import open_store  # noqa: E402

MAX_STEPS, EVERY = 110, 20
EXPERIMENT, RUN = "default", "equiv"
LOCAL_KINDS = ["kill", "ptr-deleted", "ptr-garbled", "ptr-types", "disk-full", "race"]

# Loaded into trainer processes through PYTHONPATH: from the CKPT_SOAK_DISK_FULL_AT-th file
# save on, the file the writer opens is /dev/full, so torch's own writer meets ENOSPC.
SITECUSTOMIZE = '''
import os
_at = int(os.environ.get("CKPT_SOAK_DISK_FULL_AT") or 0)
if _at:
    import trainer.storage.local as _local
    _orig, _real_temp, _n = _local.LocalStore.create_from_path, _local._temp_name, [0]

    def _create_from_path(self, key):
        _n[0] += 1
        if _n[0] >= _at:
            def _full(name):
                tmp = _real_temp(name)
                os.symlink("/dev/full", os.path.join(self.root, os.path.dirname(key), tmp))
                return tmp
            _local._temp_name = _full
        return _orig(self, key)

    _local.LocalStore.create_from_path = _create_from_path
'''


def start_trainer(config: Path, store: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", "--config", str(config), "--store", store,
         "--log-level", "DEBUG"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        env={**os.environ, **env})


def follow(proc: subprocess.Popen, at_step: int | None = None, action=None) -> tuple[int, str]:
    """Read the trainer's log to the end; call `action` once step `at_step` is done."""
    timer = threading.Timer(600, proc.kill)
    timer.start()
    lines, done = [], False
    try:
        for line in proc.stdout:
            lines.append(line)
            m = STEP_RE.search(line)
            if at_step is not None and not done and m and int(m.group(1)) >= at_step:
                action(proc)
                done = True
        return proc.wait(), "".join(lines)
    finally:
        timer.cancel()


def verifying(store_uri: str) -> set[str]:
    repo = CheckpointRepo(open_store(store_uri), EXPERIMENT, RUN)
    good = set()
    for name in repo.committed():
        try:
            repo.verify(name)
            good.add(name)
        except CheckpointError:
            pass
    return good


def final_state(store_uri: str) -> dict:
    repo = CheckpointRepo(open_store(store_uri), EXPERIMENT, RUN)
    manifest, _ = repo.find_latest_valid()
    return load_verified_state(repo, manifest)


def identical(a: dict, b: dict) -> bool:
    keys = [k for k in a if k not in ("config", "lineage", "meta")]
    try:
        assert_bitwise_equal({k: a[k] for k in keys if k in b}, {k: b[k] for k in keys if k in b})
        return set(keys) <= set(b)
    except AssertionError:
        return False


def kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)


def one_trial(kind: str, rng: random.Random, work: Path, base_env: dict, reference: dict,
              s3: dict | None) -> dict:
    config = write_config(work / "config.json", max_steps=MAX_STEPS,
                          checkpoint={"every_steps": EVERY, "keep_last": 50,
                                      "on_epoch_end": False})
    if kind == "s3-errors":
        store = f"s3://{s3['bucket']}/trial-{rng.getrandbits(40):x}"
    else:
        store = str(work / "store")
    env = dict(base_env)
    # A first attempt killed after at least one checkpoint: history that a fault could cost.
    rc, _ = follow(start_trainer(config, store, env), rng.randint(EVERY + 5, MAX_STEPS - 15), kill)
    before = verifying(store)
    expected, got = "resume", None
    ckdir = work / "store" / EXPERIMENT / RUN / "checkpoints"

    if kind == "kill":
        rc, _ = follow(start_trainer(config, store, env),
                       rng.choice(range(EVERY, MAX_STEPS, EVERY)), kill)
        expected, got = -signal.SIGKILL, rc
    elif kind.startswith("ptr-"):
        pointer = ckdir / POINTER
        if kind == "ptr-deleted":
            pointer.unlink()
        elif kind == "ptr-garbled":
            pointer.write_bytes(os.urandom(rng.randint(1, 64)))
        else:
            pointer.write_text(json.dumps({"generation": "x", "checkpoint": 7, "history": {}}))
    elif kind == "disk-full":
        if not os.path.exists("/dev/full"):
            raise SystemExit("disk-full trials need /dev/full")
        rc, log = follow(start_trainer(config, store, {**env, "CKPT_SOAK_DISK_FULL_AT":
                                                       str(rng.randint(1, 3))}))
        expected, got = 5, (rc if "No space left on device" in log else f"{rc} (no ENOSPC)")
    elif kind == "s3-errors":
        proxy = s3["proxy"]
        rc, _ = follow(start_trainer(config, store, env), rng.randint(1, MAX_STEPS - 25),
                       lambda _p: proxy.inject("503", times=10**9))
        proxy.clear()
        expected, got = 5, rc
    elif kind == "race":
        # Slow steps (not state: the run still ends identical) so that the two lifetimes
        # overlap however far apart the two processes happen to start.
        slow = write_config(work / "slow.json", max_steps=MAX_STEPS,
                            checkpoint={"every_steps": EVERY, "keep_last": 50,
                                        "on_epoch_end": False},
                            task_args={"step_delay": 0.1})
        env2 = {**env, Env.ATTEMPT: "50"}
        procs = [start_trainer(slow, store, env2) for _ in range(2)]
        rcs = sorted(follow(p)[0] for p in procs)
        expected, got = [0, 6], rcs

    newest_before = max((int(n.split("-")[1]) for n in before), default=0)
    resumed_ok = True
    for _ in range(3):
        rc, log = follow(start_trainer(config, store, env))
        if kind.startswith("ptr-") and resumed_ok:
            resumed_ok = f"at step {newest_before} " in log
        if rc == 0:
            break
    after = verifying(store)
    same = rc == 0 and identical(final_state(store), reference)
    wrong = (expected != "resume" and got != expected) or rc != 0 or not resumed_ok
    return {"kind": kind, "lost": len(before - after), "identical": same, "wrong": wrong,
            "detail": f"expected {expected} got {got}; final rc {rc}; resumed ok {resumed_ok}"}


def start_s3(work: Path) -> dict | None:
    moto = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    if not os.path.exists(moto):
        return None
    import socket

    import boto3

    from tests.fault_proxy import FaultProxy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    creds = {"AWS_ACCESS_KEY_ID": "soak", "AWS_SECRET_ACCESS_KEY": "soak",
             "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("s3", endpoint_url=endpoint, **{
        "aws_access_key_id": "soak", "aws_secret_access_key": "soak", "region_name": "us-east-1"})
    def bucket_made() -> bool:
        try:
            client.create_bucket(Bucket="soak")
        except Exception:
            return False
        return True

    try:
        wait_for(bucket_made, 30, 0.1, f"moto_server to answer on {endpoint}")
    except WaitTimeout:
        proc.kill()
        return None
    proxy = FaultProxy(endpoint)
    return {"proc": proc, "proxy": proxy, "bucket": "soak",
            "env": {**creds, "AWS_ENDPOINT_URL": proxy.endpoint,
                    "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 trials")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    top = Path(tempfile.mkdtemp(prefix="soak-faults-"))
    site = top / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    s3 = None if args.no_s3 else start_s3(top)
    if s3:
        os.environ.update(s3["env"])  # this process reads the S3 stores too
    base_env = {"PYTHONPATH": f"{site}{os.pathsep}{ROOT}", **(s3["env"] if s3 else {})}
    kinds = LOCAL_KINDS + (["s3-errors"] if s3 else [])
    try:
        ref_dir = top / "reference"
        ref_dir.mkdir()
        config = write_config(ref_dir / "config.json", max_steps=MAX_STEPS,
                              checkpoint={"every_steps": EVERY, "keep_last": 50,
                                          "on_epoch_end": False})
        rc, log = follow(start_trainer(config, str(ref_dir / "store"), base_env))
        if rc != 0:
            print(log)
            raise SystemExit(f"the uninterrupted reference run failed with exit {rc}")
        reference = final_state(str(ref_dir / "store"))
        order = [kinds[i % len(kinds)] for i in range(args.trials)]
        rng.shuffle(order)
        results = []
        for i, kind in enumerate(order):
            work = top / f"trial-{i}"
            work.mkdir()
            r = one_trial(kind, rng, work, base_env, reference, s3)
            results.append(r)
            print(f"trial {i:3d} {kind:12s} lost {r['lost']} identical {r['identical']!s:5s} "
                  f"wrong {r['wrong']!s:5s} {r['detail']}", flush=True)
            shutil.rmtree(work, ignore_errors=True)
    finally:
        if s3:
            s3["proxy"].close()
            s3["proc"].terminate()
        shutil.rmtree(top, ignore_errors=True)

    print(f"\n{'fault':12s} {'trials':>6s} {'lost':>5s} {'identical':>9s} {'wrong':>5s}")
    by = Counter(r["kind"] for r in results)
    for kind in kinds:
        rs = [r for r in results if r["kind"] == kind]
        if rs:
            print(f"{kind:12s} {by[kind]:6d} {sum(r['lost'] for r in rs):5d} "
                  f"{sum(r['identical'] for r in rs):9d} {sum(r['wrong'] for r in rs):5d}")
    lost = sum(r["lost"] for r in results)
    wrong = sum(r["wrong"] for r in results)
    same = sum(r["identical"] for r in results)
    print(f"{'all':12s} {len(results):6d} {lost:5d} {same:9d} {wrong:5d}")
    return 0 if lost == 0 and wrong == 0 and same == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
