"""Two ranks against one: what a save costs, what its barrier costs, how fast a lost rank
trains again. Printed side by side in one run.

  save       the same total state (an MLP and its AdamW state, `--mib` MiB of parameters)
             saved by one rank, and by two ranks that each write their share of it
             (`trainer.ranks.distributed`: parts spread over the ranks' files), median of
             `--saves` synchronous saves: the stall on the training thread as the
             checkpoint's manifest records it (rank 0's, which waits for the barrier)
  barrier    the save's barrier alone: rank 1's file entries to rank 0 (gather) on the
             session's gloo group, when both ranks arrive together, median of 50
  kill       SIGKILL of rank 1 of a two-rank job (`python -m trainer.ranks`, toy task,
             uninterrupted by anything else) -> the relaunched job's first completed step,
             the launcher started again at once (as the in-run relaunch does), median of
             `--kills`; start-up (torchrun, interpreters, torch, rendezvous) included

  --fsdp     the save stall alone, of the same MLP sharded by FSDP2 (`fully_shard` on every
             layer and the root) and saved through DCP (`trainer.ranks.sharded`): each rank
             writes its shards, rank 0 the metadata and the manifest, one rank and two;
             synchronous saves, then background ones (`async_save=True`: the stall is
             the training thread's copy of its shards, the write runs on the save's
             thread and group), and the background stall over the synchronous one

    python benchmarks/bench_ranks.py [--mib 256] [--saves 5] [--kills 3] [--fsdp]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.polling import wait_for  # noqa: E402
from tests.rank_runs import (  # noqa: E402
    env,
    free_port,
    pointer_step,
    rank_pids,
    start_torchrun,
    trainer_argv,
    wait_for_step,
)
from tests.trainer_proc import write_config  # noqa: E402
from trainer.ranks.world import LOCAL_RANK_ENV, RANK_ENV, WORLD_SIZE_ENV  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEP_RE = re.compile(r"step (\d+) done")


def worker(store: str, mib: int, saves: int, out: str, fsdp: bool = False,
           async_save: bool = False) -> None:
    """One rank (or the only one): build the state, save it `saves` times, time a barrier."""
    import torch
    import torch.distributed as dist

    from trainer import CheckpointSession

    world = int(os.environ.get(WORLD_SIZE_ENV, 1))
    if world > 1 or fsdp:  # FSDP2 needs a process group, even of one
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    width = 1024
    layers = max(1, mib * 2**20 // (4 * width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)])
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # the optimizer's state exists: two more copies of the parameters
    ckpt = CheckpointSession(run=f"w{world}", store=store, every_steps=1,
                             keep_last=saves + 1, install_signals=False,
                             async_save=async_save)
    ckpt.restore(model=model, optimizer=opt)
    for step in range(1, saves + 1):
        ckpt.step(step)
        # A background save is let finish before the next step, so that each stall
        # is the training thread's own (the copy), not a wait for the previous write.
        ckpt._ck.wait()
    barrier = []
    if ckpt.ranks is not None:
        for _ in range(50):
            t0 = time.perf_counter()
            ckpt.ranks.to_leader(({"state-rank1.pt": None}, {}))
            barrier.append(time.perf_counter() - t0)
    ckpt.close()
    if ckpt.leads:
        Path(out).write_text(json.dumps({"barrier": barrier}))


def stalls(store: Path, run: str) -> list[float]:
    """Each committed save's stall, as its manifest records it (all of them are kept)."""
    ckdir = store / "default" / run / "checkpoints"
    return [json.loads((d / "MANIFEST.json").read_text())["meta"]["blocking_seconds"]
            for d in ckdir.glob("step-*") if (d / "MANIFEST.json").exists()]


def run_workers(world: int, store: Path, mib: int, saves: int, work: Path,
                fsdp: bool = False, async_save: bool = False) -> None:
    out = work / f"w{world}.json"
    argv = [sys.executable, __file__, "--worker", "--store", str(store), "--mib", str(mib),
            "--saves", str(saves), "--out", str(out), *(["--fsdp"] if fsdp else []),
            *(["--async-save"] if async_save else [])]
    port = str(free_port())
    procs = [subprocess.Popen(argv, cwd=ROOT, env={
        **env(0), RANK_ENV: str(r), LOCAL_RANK_ENV: str(r), WORLD_SIZE_ENV: str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}) for r in range(world)] \
        if world > 1 or fsdp else [subprocess.Popen(argv, cwd=ROOT, env=env(0))]
    assert [p.wait() for p in procs] == [0] * world


# What this benchmark sets that a user would not, printed with its figures: it times one
# save's stall, so it saves at every step and lets each background save finish before the
# next step; the kill figure's run checkpoints every 20 steps.
SAVE_SETS = ("sets what a user would not: every_steps=1 and each background save waited "
             "for before the next step (one save's stall alone)")
SETS = (f"{SAVE_SETS}; for the kill figure every_steps=20 and a step of at least 20 ms (the "
        "toy task's step_delay)")


def kill_to_first_step(kills: int, work: Path) -> list[float]:
    config = write_config(work / "kill.json", max_steps=100000, eval_every=0,
                          checkpoint={"every_steps": 20}, distributed={"nproc_per_node": 2})
    store, log = work / "kill-store", work / "kill.log"
    out = []
    argv = [*trainer_argv(config, str(store)), "--log-level", "DEBUG"]  # "step N done"
    launcher = start_torchrun(argv, 2, env(0.02), log)
    for _ in range(kills):
        ranks = rank_pids(launcher, 2)
        # Training, with a checkpoint to resume from, some steps after it.
        wait_for_step(store, "default", "equiv", pointer_step(store, "default", "equiv") + 40,
                      launcher)
        mark = log.stat().st_size
        t_kill = time.monotonic()
        os.kill(ranks[1], signal.SIGKILL)
        launcher.wait(timeout=120)
        launcher = start_torchrun(argv, 2, env(0.02), log)
        wait_for(partial(_first_step_after_resume, log, mark), 300, 0.02,
                 "the relaunched job's first step")
        out.append(time.monotonic() - t_kill)
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=120)
    return out


def _first_step_after_resume(log: Path, mark: int) -> bool:
    with log.open() as f:
        f.seek(mark)
        text = f.read()
    at = text.find("resumed from")
    return at >= 0 and STEP_RE.search(text, at) is not None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--store")
    p.add_argument("--out")
    a = p.parse_args()
    if a.worker:
        return worker(a.store, a.mib, a.saves, a.out, a.fsdp, a.async_save)
    if a.fsdp:
        return main_fsdp(a)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        one = statistics.median(stalls_of(1, a, work))
        two_runs = stalls_of(2, a, work)
        two = statistics.median(two_runs)
        barrier = json.loads((work / "w2.json").read_text())["barrier"]
        kills = kill_to_first_step(a.kills, work)
    state = a.mib * 3
    print(f"state: {a.mib} MiB of parameters + AdamW's two moments = {state} MiB; "
          f"{a.saves} saves each; load average {os.getloadavg()[0]:.2f}")
    print(SETS)
    print(f"{'':36}{'one rank':>12}{'two ranks':>12}{'ratio':>8}")
    print(f"{'save stall (median, s)':36}{one:12.3f}{two:12.3f}{two / one:8.2f}")
    print(f"{'barrier per save (median, ms)':36}{'-':>12}"
          f"{statistics.median(barrier) * 1e3:12.2f}")
    print(f"{'kill rank 1 -> first step (s)':36}{'-':>12}{statistics.median(kills):12.2f}"
          f"   ({', '.join(f'{k:.2f}' for k in kills)})")


def stalls_of(world: int, a, work: Path, async_save: bool = False) -> list[float]:
    store = work / f"store-{world}{'-async' if async_save else ''}"
    run_workers(world, store, a.mib, a.saves, work, a.fsdp, async_save)
    return stalls(store, f"w{world}")


def main_fsdp(a) -> None:
    """The save stall of FSDP2 state through DCP, one rank against two."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        one, two = (statistics.median(stalls_of(w, a, work)) for w in (1, 2))
        aone, atwo = (statistics.median(stalls_of(w, a, work, True)) for w in (1, 2))
    print(f"FSDP2 through DCP: {a.mib} MiB of parameters + AdamW's two moments = "
          f"{a.mib * 3} MiB, sharded; {a.saves} saves of each kind; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(SAVE_SETS)
    print(f"{'':36}{'one rank':>12}{'two ranks':>12}{'ratio':>8}")
    print(f"{'synchronous save stall (median, s)':36}{one:12.3f}{two:12.3f}{two / one:8.2f}")
    print(f"{'background save stall (median, s)':36}{aone:12.3f}{atwo:12.3f}{atwo / aone:8.2f}")
    print(f"{'background / synchronous':36}{aone / one:12.3f}{atwo / two:12.3f}")


if __name__ == "__main__":
    main()
