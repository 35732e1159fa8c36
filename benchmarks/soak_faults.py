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
    fifo-in-data  a FIFO appears in the run's dataset directory; expect exit 2 naming it,
                  within FIFO_DEADLINE_S (a reader that opened it would block for ever),
                  then the FIFO is removed and the run resumes
    fork-and-exit the trainer started by a launcher that forks and exits 0 once the trainer
                  committed, run as the orchestrator runs an attempt (a process group of its
                  own, stopped when its main process exits); expect `unfinished`, never a
                  success, and no process of the attempt left running
    env-override  another run, registered by hand with an env naming this run (CKPT_RUN,
                  CKPT_ATTEMPT), is launched as model_checkpoint launches a command; expect
                  it to write its own run only, this run's pointer and checkpoints untouched
    long-step     the attempt's first step lasts 3x a shortened heartbeat timeout (a
                  compiled first step); the reconciler's own judgement (ckpt_assets.lifecycle.liveness)
                  reads the heartbeat every 0.1 s throughout; expect it never to find the
                  trainer dead or stalled, and the attempt to finish (0)

It prints a matrix: trials, committed checkpoints lost (verifying before the fault, gone or
failing after; must be 0, keep_last is high so retention drops nothing), runs that ended
bitwise identical to an uninterrupted run, and exits classified other than expected.

    python benchmarks/soak_faults.py --trials 20 --seed 7
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckpt_assets.lifecycle.liveness import judge  # noqa: E402
from ckpt_assets.lifecycle.settings import ResumeSettings  # noqa: E402
from tests.polling import WaitTimeout, pid_alive, wait_for  # noqa: E402
from tests.trainer_proc import STEP_RE, assert_bitwise_equal, write_config  # noqa: E402
from trainer.api.state_files import load_verified_state  # noqa: E402
from trainer.base.errors import CheckpointError  # noqa: E402
from trainer.base.outcomes import Outcome  # noqa: E402
from trainer.checkpoints.layout import POINTER  # noqa: E402
from trainer.checkpoints.repo import CheckpointRepo  # noqa: E402
from trainer.process.contract import Env  # noqa: E402
from trainer.storage import open_store  # noqa: E402

MAX_STEPS, EVERY = 110, 20
EXPERIMENT, RUN = "default", "equiv"
LOCAL_KINDS = ["kill", "ptr-deleted", "ptr-garbled", "ptr-types", "disk-full", "race",
               "fifo-in-data", "fork-and-exit", "long-step", "env-override"]
# fifo-in-data: the run versions a directory of files while it trains on the toy task's
# data, so it ends identical to the reference; a trainer still running after the deadline
# was blocked on the FIFO.
DIRECTORY_TASK = "tests.user_tasks:directory_dataset"
FIFO_DEADLINE_S = 60
GRACE_S = 20.0  # the orchestrator's default grace period (TrainerResource)
# long-step: the heartbeat timeout it is judged by, and the trainer's beat interval.
LONG_TIMEOUT_S, LONG_BEAT_S = 2.0, 0.25

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


def trainer_argv(config: Path, store: str) -> list[str]:
    return [sys.executable, "-m", "trainer", "--config", str(config), "--store", store,
            "--log-level", "DEBUG"]


def start_trainer(config: Path, store: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(trainer_argv(config, store), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, **env})


def follow(proc: subprocess.Popen, at_step: int | None = None, action=None,
           timeout: float = 600) -> tuple[int, str]:
    """Read the trainer's log to the end; call `action` once step `at_step` is done."""
    timer = threading.Timer(timeout, proc.kill)
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


def fork_and_exit(work: Path, store: str, env: dict) -> str:
    """One attempt of a forking launcher, run and classified as the orchestrator does."""
    from ckpt_assets.attempt.messages import exit_outcome
    from ckpt_assets.attempt.process import run_to_end

    # Slow steps (not state) so that the run is far from its end when the launcher exits.
    slow = write_config(work / "slow.json", max_steps=MAX_STEPS,
                        checkpoint={"every_steps": EVERY, "keep_last": 50,
                                    "on_epoch_end": False},
                        task_args={"step_delay": 0.2})
    pointer = work / "store" / EXPERIMENT / RUN / "checkpoints" / POINTER
    pids = work / "pids.json"
    argv = [sys.executable, str(ROOT / "tests" / "attempt_commands.py"), "fork-and-exit",
            "--pointer", str(pointer), "--pids", str(pids), "--", *trainer_argv(slow, store)]
    done = run_to_end(argv, {**os.environ, **env}, str(ROOT), str(work / "attempt.log"),
                      GRACE_S, logging.getLogger("soak"))
    repo = CheckpointRepo(open_store(store), EXPERIMENT, RUN)
    m = repo.read_manifest(repo.read_pointer().checkpoint)
    outcome = exit_outcome(done.returncode, None, final=m.meta.get("final") is True,
                           committed=True, left_running=len(done.left_running))
    stray = [p for p in json.loads(pids.read_text()).values() if pid_alive(p)]
    if not done.left_running:
        return f"{outcome.value}, but the launcher left nothing running (no fault happened)"
    return outcome.value + (f", {len(stray)} process(es) still running" if stray else "")


def env_override(work: Path, store: str, env: dict) -> str:
    """An attempt of another run, `attacker`, whose registered config's env names this run
    (written past the registration check, which refuses it), launched as `model_checkpoint`
    launches a command: it must train its own run and leave this one untouched."""
    from ckpt_assets.attempt.command import AttemptIds, base_env, command_launch, contract
    from ckpt_assets.base.registration import Registration
    from ckpt_assets.defs.resources import TrainerResource
    from trainer.config import config_from_dict

    victim = CheckpointRepo(open_store(store), EXPERIMENT, RUN)
    before = (victim.read_pointer(), sorted(victim.committed()))
    own = write_config(work / "attacker.json", run="attacker", max_steps=EVERY * 2)
    cfg = config_from_dict({"run": "attacker", "command": trainer_argv(own, store)})
    cfg = cfg.model_copy(update={"env": {Env.RUN.value: RUN, Env.ATTEMPT.value: "99",
                                         Env.EXPERIMENT.value: EXPERIMENT}})
    reg = Registration("attacker", EXPERIMENT, cfg, "file:///by-hand/config.json", "0" * 64)
    repo = CheckpointRepo(open_store(store), EXPERIMENT, "attacker")
    trainer = TrainerResource(extra_env=dict(env))
    told = contract(reg, store, AttemptIds(1, "soak-attacker", "soak-attacker", None),
                    _no_dataset())
    launch = command_launch(reg, repo, told, base_env(trainer, {}), trainer,
                            logging.getLogger("soak"))
    rc = subprocess.run(launch.argv, env=launch.env, cwd=launch.cwd, capture_output=True,
                        timeout=600).returncode
    after = (victim.read_pointer(), sorted(victim.committed()))
    if after != before:
        return f"wrote into {RUN} (attacker exit {rc})"
    return "own run only" if rc == 0 and repo.read_pointer() else f"attacker exit {rc}"


def _no_dataset():
    from ckpt_assets.base.datasets import DatasetRecord

    return DatasetRecord(kind="generated", version="soak")


class LivenessWatch(threading.Thread):
    """Judges a trainer's heartbeat as the reconciler does, every 0.1 s, from its first beat
    (its start-up is not what is judged here) until stopped; keeps every verdict."""

    def __init__(self, store: str, proc: subprocess.Popen):
        super().__init__(daemon=True)
        self.repo = CheckpointRepo(open_store(store), EXPERIMENT, RUN)
        self.proc, self.verdicts, self.beats = proc, [], []
        self.settings = ResumeSettings(heartbeat_timeout_s=LONG_TIMEOUT_S)
        self._halt = threading.Event()

    def run(self) -> None:
        first = None
        while not self._halt.wait(0.1):
            beat = self.repo.read_beat()
            if beat is None or beat.pid != self.proc.pid:
                beat = None  # an earlier attempt's: not this trainer's
            elif first is None:
                first = time.time()
            if beat is not None and (not self.beats or beat.time != self.beats[-1].time):
                self.beats.append(beat)
            if first is not None and self.proc.poll() is None:
                verdict = judge(beat, "", first, time.time(), self.settings)
                if verdict is not None:
                    self.verdicts.append(verdict.outcome.value)

    def stop(self) -> str:
        self._halt.set()
        self.join(10)
        gaps = [b.time - a.time for a, b in zip(self.beats, self.beats[1:], strict=False)]
        steps = sorted({(b.step, b.step_time) for b in self.beats
                        if b.step is not None and b.step_time is not None})
        longest = max((t2 - t1 for (_, t1), (_, t2) in zip(steps, steps[1:], strict=False)),
                      default=0.0)
        return (f"; longest step {longest:.1f}s = {longest / LONG_TIMEOUT_S:.1f}x the "
                f"timeout, longest heartbeat gap {max(gaps, default=0.0):.2f}s")


def one_trial(kind: str, rng: random.Random, work: Path, base_env: dict, reference: dict,
              s3: dict | None) -> dict:
    data = work / "data"
    extra = {}
    if kind == "fifo-in-data":
        (data / "shard").mkdir(parents=True)
        for i in range(rng.randint(1, 4)):
            (data / "shard" / f"part-{i}.bin").write_bytes(rng.randbytes(rng.randint(1, 4096)))
        extra = {"task": DIRECTORY_TASK, "dataset": str(data)}
    config = write_config(work / "config.json", max_steps=MAX_STEPS,
                          checkpoint={"every_steps": EVERY, "keep_last": 50,
                                      "on_epoch_end": False}, **extra)
    if kind == "s3-errors":
        store = f"s3://{s3['bucket']}/trial-{rng.getrandbits(40):x}"
    else:
        store = str(work / "store")
    env = dict(base_env)
    # A first attempt killed after at least one checkpoint: history that a fault could cost.
    rc, _ = follow(start_trainer(config, store, env), rng.randint(EVERY + 5, MAX_STEPS - 15), kill)
    before = verifying(store)
    expected, got, note = "resume", None, ""
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
    elif kind == "fork-and-exit":
        expected, got = Outcome.UNFINISHED.value, fork_and_exit(work, store, env)
    elif kind == "env-override":
        expected, got = "own run only", env_override(work, store, env)
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
    elif kind == "fifo-in-data":
        fifo = data / rng.choice(["", "shard"]) / "incoming.pipe"
        os.mkfifo(fifo)
        rc, log = follow(start_trainer(config, store, env), timeout=FIFO_DEADLINE_S)
        named = f"'{fifo.relative_to(data).as_posix()}' is a FIFO" in log
        expected, got = 2, (rc if named else f"{rc} (FIFO not named)")
        fifo.unlink()
    elif kind == "long-step":
        # The same training (tests.liveness_tasks is the toy task), its first step long.
        long = write_config(work / "long.json", max_steps=MAX_STEPS,
                            task="tests.liveness_tasks:build",
                            checkpoint={"every_steps": EVERY, "keep_last": 50,
                                        "on_epoch_end": False, "heartbeat_seconds": LONG_BEAT_S},
                            task_args={"long_step_s": 3 * LONG_TIMEOUT_S})
        proc = start_trainer(long, store, env)
        watch = LivenessWatch(store, proc)
        watch.start()
        rc, _ = follow(proc)
        note = watch.stop()
        expected, got = (0, "never dead or stalled"), (rc, ", ".join(watch.verdicts)
                                                      or "never dead or stalled")

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
            "detail": f"expected {expected} got {got}; final rc {rc}; resumed ok {resumed_ok}"
                      f"{note}"}


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
    ap.add_argument("--kinds", default=None,
                    help="comma-separated faults to try (default: all), e.g. long-step")
    args = ap.parse_args()
    every = [*LOCAL_KINDS, "s3-errors"]
    wanted = set(args.kinds.split(",")) if args.kinds else set(every)
    if wanted - set(every):
        raise SystemExit(f"unknown fault(s) {', '.join(sorted(wanted - set(every)))}; choose "
                         f"from {', '.join(every)}")
    rng = random.Random(args.seed)
    top = Path(tempfile.mkdtemp(prefix="soak-faults-"))
    site = top / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    s3 = None if args.no_s3 else start_s3(top)
    if s3:
        os.environ.update(s3["env"])  # this process reads the S3 stores too
    base_env = {"PYTHONPATH": f"{site}{os.pathsep}{ROOT}", **(s3["env"] if s3 else {})}
    kinds = [k for k in LOCAL_KINDS + (["s3-errors"] if s3 else []) if k in wanted]
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
            print(f"trial {i:3d} {kind:13s} lost {r['lost']} identical {r['identical']!s:5s} "
                  f"wrong {r['wrong']!s:5s} {r['detail']}", flush=True)
            shutil.rmtree(work, ignore_errors=True)
    finally:
        if s3:
            s3["proxy"].close()
            s3["proc"].terminate()
        shutil.rmtree(top, ignore_errors=True)

    print(f"\n{'fault':13s} {'trials':>6s} {'lost':>5s} {'identical':>9s} {'wrong':>5s}")
    by = Counter(r["kind"] for r in results)
    for kind in kinds:
        rs = [r for r in results if r["kind"] == kind]
        if rs:
            print(f"{kind:13s} {by[kind]:6d} {sum(r['lost'] for r in rs):5d} "
                  f"{sum(r['identical'] for r in rs):9d} {sum(r['wrong'] for r in rs):5d}")
    lost = sum(r["lost"] for r in results)
    wrong = sum(r["wrong"] for r in results)
    same = sum(r["identical"] for r in results)
    print(f"{'all':13s} {len(results):6d} {lost:5d} {same:9d} {wrong:5d}")
    return 0 if lost == 0 and wrong == 0 and same == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
