"""Our checkpointing beside what users would otherwise pick, in one run.

(a) Saving, on one model and optimizer state (a stack of Linear layers and AdamW's two
    moments: >= 1 GB together), each to the same disk, in turn:

    ours      `CheckpointSession(async_save=True, every_steps=...)`, the save fired by the
              step trigger inside `ckpt.step(loss=loss)` (the user's path)
    DCP       `torch.distributed.checkpoint.async_save` of `get_state_dict(model, opt)` with
              its recommended staging for torch 2.13: a `DefaultStager` kept across saves
              (its staging buffers reused), asynchronous staging, pinned memory and
              non-blocking copies where CUDA is present, the default thread executor; the
              loop waits for `staging_completion` before its next `optimizer.step()` (the
              one write that would tear the snapshot), as torch's docs ask
    torch.save  `torch.save({"model": ..., "optim": ...})` of the live state, then fsync

    Per save: the save call's stall (the `ckpt.step` call that fired it, less that call's
    usual cost; DCP's `get_state_dict` + `async_save`; `torch.save` + fsync); the mean and
    worst of the 5 steps after it over a normal step (the median of the 5 steps before it);
    and the time from the save call until the checkpoint is durable (ours: the pointer names
    it; DCP: `upload_completion` done, files fsynced; torch.save: the call's end). Each way
    saves three times (the first save allocates its buffers; all are printed); the figures
    are the medians over the later saves. Targets: our stall <= DCP's; the 5 steps after our
    save <= 1.10 x a normal step.

(b) Restarting a killed trainer, the same script (`python -m trainer --config FILE`, the
    built-in task) both ways: ours, launched with `ckpt-assets launch` under a real
    dagster-daemon on the embedded default instance, relaunched in its Dagster run (the
    defaults: in-run relaunch and the warm trainer on, the default budgets and back-off),
    against `torchrun --standalone --nproc-per-node 1 --max-restarts N` (its default
    monitor interval). SIGKILL of the trainer process 50 steps (5 s) into each attempt -> its
    next attempt's first completed step (the heartbeat each attempt writes to the store,
    every step). Target: ours <= 0.5 x torchrun's (medians). Then, ours only, kills 12 steps
    (1.2 s) into each attempt: the standby for the next attempt, started beside this one,
    may still be importing torch then, and the relaunch waits for the rest of its import.
    torchrun's figure does not depend on when the kill comes (it starts a fresh interpreter
    either way), so its series at 50 steps stands for both.

    python benchmarks/bench_peers.py [--layers 6] [--width 4096] [--kills 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from peers_saves import SAVERS, Result, measure  # noqa: E402
from torch import nn  # noqa: E402

from tests.polling import pid_alive, wait_for  # noqa: E402
from trainer.checkpoints.repo import CheckpointRepo  # noqa: E402
from trainer.storage import open_store  # noqa: E402

AFTER_TARGET, STALL_TARGET, RESTART_TARGET = 1.10, 1.0, 0.5
TORCHRUN = Path(sys.executable).with_name("torchrun")


def mark(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def build(layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return model, opt, torch.randn(16, width)


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(v.numel() * v.element_size() for s in opt.state.values()
                  for v in s.values() if isinstance(v, torch.Tensor))
    return params + moments


def bench_saves(args) -> dict[str, Result]:
    model, opt, x = build(args.layers, args.width)
    for _ in range(2):  # AdamW's moments exist after its first step: the full state
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
    size = state_bytes(model, opt)
    print(f"(a) saving: {args.layers} x Linear({args.width}, {args.width}) + AdamW state = "
          f"{size / 1e9:.2f} GB; batch 16; {torch.get_num_threads()} torch thread(s); disk "
          f"under {args.dir}")
    print("    ours sets: async_save=True and its step trigger (every_steps), nothing else; "
          "DCP: DefaultStager(StagingOptions(use_pinned_memory=%s, use_shared_memory=False, "
          "use_async_staging=True, use_non_blocking_copy=%s)), thread executor"
          % ((torch.cuda.is_available(),) * 2))
    results = {}
    for name, saver in SAVERS.items():
        work = Path(tempfile.mkdtemp(prefix=f"peers-{name.replace('.', '-')}-", dir=args.dir))
        try:
            results[name] = measure(saver, model, opt, x, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        r = results[name]
        for i, s in enumerate(r.saves, 1):
            print(f"    {name:<10} save {i}: stall {s.stall:7.3f} s; after/normal mean "
                  f"{s.after_mean:5.2f} worst {s.after_worst:5.2f} (normal step "
                  f"{s.normal:6.3f} s); durable after {s.durable:6.2f} s", flush=True)
    return results


def print_saves(results: dict[str, Result]) -> None:
    print("\n    the saves after the first (which allocates buffers), median of each figure:")
    print(f"    {'':<10} {'stall s':>8} {'stall/torch.save':>17} {'after mean':>11} "
          f"{'after worst':>12} {'durable s':>10}")
    steady = {name: r.steady() for name, r in results.items()}
    base = steady["torch.save"].stall
    for name, s in steady.items():
        print(f"    {name:<10} {s.stall:8.3f} {s.stall / base:17.4f} {s.after_mean:11.2f} "
              f"{s.after_worst:12.2f} {s.durable:10.2f}")
    ours, dcp = steady["ours"], steady["DCP"]
    print(f"    target: our stall <= DCP's: {mark(ours.stall <= STALL_TARGET * dcp.stall)} "
          f"({ours.stall:.3f} s vs {dcp.stall:.3f} s, ratio {ours.stall / dcp.stall:.2f})")
    ok = ours.after_mean <= AFTER_TARGET and ours.after_worst <= AFTER_TARGET
    print(f"    target: the 5 steps after our save <= {AFTER_TARGET:.2f} x a normal step: "
          f"{mark(ok)} (mean {ours.after_mean:.2f}, worst {ours.after_worst:.2f}; DCP mean "
          f"{dcp.after_mean:.2f}, worst {dcp.after_worst:.2f})")


# -- (b) restarts ---------------------------------------------------------------------------
def heartbeat(store: str, run: str) -> dict | None:
    try:
        return CheckpointRepo(open_store(store), "default", run).read_heartbeat()
    except Exception:
        return None


def first_step_of_next_attempt(store: str, run: str, attempt: int, timeout: float) -> dict:
    def got():
        hb = heartbeat(store, run)
        return hb if hb and int(hb.get("attempt", 0)) > attempt and \
            int(hb["step"]) > int(hb.get("resumed_step", -1)) else None
    return wait_for(got, timeout, 0.02, f"the first step of an attempt after {attempt}")


def kill_each(store: str, run: str, schedule: list[int], timeout: float) -> list[float]:
    """SIGKILL the trainer once per entry of `schedule`, that many steps into an attempt;
    the seconds from each kill to the next attempt's first completed step."""
    hb = first_step_of_next_attempt(store, run, 0, timeout)
    out = []
    for after_steps in schedule:
        attempt, target = int(hb["attempt"]), int(hb["step"]) + after_steps
        hb = wait_for(lambda a=attempt, t=target: (h := heartbeat(store, run)) and
                      int(h["attempt"]) == a and int(h["step"]) >= t and h, timeout, 0.02,
                      f"attempt {attempt} at step {target}")
        pid, t_kill = int(hb["pid"]), time.time()
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda p=pid: not pid_alive(p), 60, 0.02, f"pid {pid} gone")
        hb = first_step_of_next_attempt(store, run, attempt, timeout)
        out.append(float(hb["time"]) - t_kill)
        print(f"      kill {len(out)}, {after_steps} steps in: attempt {attempt} -> "
              f"{hb['attempt']}, first step after {out[-1]:.2f} s", flush=True)
    return out


def restart_torchrun(cfg: dict, schedule: list[int], timeout: float) -> list[float]:
    work = Path(tempfile.mkdtemp(prefix="peers-torchrun-"))
    store, path = str(work / "store"), work / "run.json"
    path.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for k in [k for k in env if k.startswith(("CKPT_", "DAGSTER_PIPES_"))]:
        env.pop(k)
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "1", "--max-restarts",
           str(len(schedule)), "-m", "trainer", "--config", str(path), "--store", store]
    print(f"    torchrun: {' '.join(cmd[1:6])} -m trainer --config run.json --store ...")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(work / "torchrun.log", "w"), start_new_session=True)
    try:
        return kill_each(store, cfg["run"], schedule, timeout)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
        shutil.rmtree(work, ignore_errors=True)


def restart_ours(cfg: dict, schedule: list[int], timeout: float) -> list[float]:
    from ckpt_assets.attempt.process import PROCESS_STARTED, WARM_STARTED
    from ckpt_assets.lifecycle.policy import PolicyConfig
    from ckpt_assets.lifecycle.settings import Setting
    from tests.daemon_harness import PROJECT_WORKSPACE, Daemon

    work = Path(tempfile.mkdtemp(prefix="peers-ours-"))
    store = str(work / "store")
    # The harness shortens the back-off for tests; the shipped default is put back.
    env = {Setting.BACKOFF_BASE_S.value: str(PolicyConfig().backoff_base_s)}
    daemon = Daemon.start(work, store, extra_env=env, workspace=PROJECT_WORKSPACE)
    print("    ours: dagster-daemon on the embedded instance; ckpt-assets launch RUN --config "
          "run.json; every other setting at its default")
    try:
        daemon.launch(cfg["run"], cfg, work)
        out = kill_each(store, cfg["run"], schedule, timeout)
        started = [m for r in daemon.runs(cfg["run"]) for e in daemon.instance.all_logs(r.run_id)
                   if (m := e.user_message or "").startswith(PROCESS_STARTED)][1:]
        print(f"      relaunches started by the warm standby: "
              f"{sum(WARM_STARTED in m for m in started)} of {len(started)}")
        return out
    finally:
        daemon.cli("stop", cfg["run"])
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


def bench_restarts(args) -> None:
    from tests.daemon_harness import training_config

    cfg = training_config("peers-restart", max_steps=100_000, eval_every=0,
                          checkpoint={"every_steps": 10, "heartbeat_seconds": 0},
                          task_args={"step_delay": 0.1})
    k, late, early = args.kills, args.after_steps, args.early_steps
    print(f"\n(b) restart: SIGKILL of the trainer -> its next attempt's first step; {k} kills "
          f"each way, {late} steps into each attempt; then {k} of ours {early} steps in, "
          "while the next attempt's standby may still be importing; the built-in task "
          "(0.1 s a step), checkpoint every 10 steps, heartbeat every step (to time the "
          "first step)")
    ours = restart_ours(cfg, [late] * k + [early] * k, args.timeout)
    ours, ours_early = ours[:k], ours[k:]
    theirs = restart_torchrun(cfg, [late] * k, args.timeout)
    mo, mt = statistics.median(ours), statistics.median(theirs)
    for name, got in (("ours (in-run relaunch)", ours), ("torchrun --max-restarts", theirs),
                      (f"ours, {early} steps in", ours_early)):
        print(f"    {name:<29} median {statistics.median(got):6.2f} s  worst "
              f"{max(got):6.2f} s  (ratio {statistics.median(got) / mt:.2f} to torchrun's)")
    print(f"    target: ours <= {RESTART_TARGET} x torchrun's: {mark(mo <= RESTART_TARGET * mt)} "
          f"(ratio {mo / mt:.2f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--kills", type=int, default=3, help="kills each way in (b), each after "
                   "progress (0: skip (b))")
    p.add_argument("--after-steps", type=int, default=50, help="steps into an attempt a "
                   "kill comes: 5 s, past a commit (every 10), so each kill follows progress")
    p.add_argument("--early-steps", type=int, default=12, help="steps into an attempt each "
                   "of the second series of our kills comes")
    p.add_argument("--timeout", type=float, default=300, help="per wait in (b), seconds")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="the disk saved to in (a)")
    p.add_argument("--skip-saves", action="store_true")
    args = p.parse_args()
    print(f"bench_peers: {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; torch {torch.__version__}")
    if not args.skip_saves:
        print_saves(bench_saves(args))
    if args.kills:
        bench_restarts(args)


if __name__ == "__main__":
    main()
