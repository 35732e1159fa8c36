"""The own-loop API's cost, measured side by side in one run.

(a) Per-step overhead of `CheckpointSession.step`, called as the README writes it: inside
    `for epoch in ckpt.epochs(...)` / `for b in ckpt.batches()`, `ckpt.step(loss=loss)`
    with the step's loss tensor (no step number, no `.item()`), against the same training
    loop of a small model without the session (plain `range` loops, no `.item()`). The
    session's save triggers are off so that no commit falls inside a timed block (printed);
    everything else is at its default (the heartbeat, every 5 s). Both loops run in
    alternating blocks of one epoch each, and each pair of adjacent blocks gives one ratio
    (time with session) / (bare time), so that a change in the machine's load hits both
    sides of a ratio alike; the figure is the median of those ratios, in CPU time of the
    training thread (what the loop costs, whatever else the machine runs) and in wall-clock
    time. Target: <= 1.01. The cost of one `step` call, timed inside the loop (with its
    caches as cold as the training work leaves them), is printed too: for another model the
    overhead is about that over its own step time. So is the call alone, back to back, with
    a loss tensor, in CPU time and in wall-clock time (target <= 2 us a call).

(b) DataLoader resume: time to the first batch of a `ResumableLoader` (two worker
    processes) restored in the middle of an epoch, against a fresh loader's first batch,
    and against the naive alternative (a fresh DataLoader iterated past the batches
    already trained on). Each includes building the loader (and loading its state).
    Target: resumed / fresh <= 1.2.

    python benchmarks/bench_session.py [--reps 10] [--steps 1000] [--block 50] [--loader-reps 15]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from trainer import CheckpointSession, ResumableLoader  # noqa: E402

# What the benchmark sets that a user would not: no commit inside a timed block.
OFF = {"every_steps": None, "on_epoch_end": False, "on_best": False}


def small_model() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    return model, opt, x, y


def train_steps(model, opt, x, y, n: int) -> tuple[float, float]:
    """One epoch of `n` steps of the plain loop: (CPU seconds of this thread, wall-clock
    seconds)."""
    loss_f = nn.functional.cross_entropy
    c0, t0 = time.thread_time(), time.perf_counter()
    for _b in range(n):
        opt.zero_grad(set_to_none=True)
        loss = loss_f(model(x), y)
        loss.backward()
        opt.step()
    return time.thread_time() - c0, time.perf_counter() - t0


def train_epoch(model, opt, x, y, ckpt: CheckpointSession, epochs) -> tuple[float, float]:
    """The next epoch of the README's loop: `epochs` is the running `ckpt.epochs(...)`."""
    loss_f = nn.functional.cross_entropy
    c0, t0 = time.thread_time(), time.perf_counter()
    next(epochs)
    for _b in ckpt.batches():
        opt.zero_grad(set_to_none=True)
        loss = loss_f(model(x), y)
        loss.backward()
        opt.step()
        ckpt.step(loss=loss)
    return time.thread_time() - c0, time.perf_counter() - t0


def session(store: Path, run: str, **parts) -> CheckpointSession:
    s = CheckpointSession(run=run, store=str(store), resume="never", **OFF)
    s.restore(**parts)
    return s


def bench_step_overhead(reps: int, steps: int, block: int, store: Path) -> None:
    """Each repetition trains `steps` steps each way, in alternating blocks of `block`
    steps; a pair of adjacent blocks (one each way, the order alternating) gives one ratio,
    so that a change in the machine's load hits both sides of a ratio alike."""
    model, opt, x, y = small_model()
    train_steps(model, opt, x, y, block * 20)  # warm up allocator and kernels
    cpu = {"bare": [], "session": [], "ratio": []}
    wall = {"bare": [], "session": [], "ratio": []}
    for rep in range(reps):
        ck = session(store, f"overhead-{rep}", model=model, optimizer=opt)
        epochs = ck.epochs(steps // block, block)
        for i in range(steps // block):
            got = {}
            for which in (("bare", "session") if (rep + i) % 2 == 0 else ("session", "bare")):
                got[which] = (train_epoch(model, opt, x, y, ck, epochs) if which == "session"
                              else train_steps(model, opt, x, y, block))
            for k, d in ((0, cpu), (1, wall)):
                d["bare"].append(got["bare"][k] / block)
                d["session"].append(got["session"][k] / block)
                d["ratio"].append(got["session"][k] / got["bare"][k])
        ck.close()  # commits the last step: outside the timed blocks

    # The call itself, timed inside the same loop (its caches as cold as training leaves them).
    ck = session(store, "per-call", model=model, optimizer=opt)
    loss_f, per_call = nn.functional.cross_entropy, []
    for _epoch in ck.epochs(steps // block, block):
        for _b in ck.batches():
            opt.zero_grad(set_to_none=True)
            loss = loss_f(model(x), y)
            loss.backward()
            opt.step()
            t0 = time.perf_counter_ns()
            ck.step(loss=loss)
            per_call.append((time.perf_counter_ns() - t0) / 1e9)
    ck.close()
    # The call alone, back to back (warm caches), with one loss tensor: CPU time of this
    # thread, which a busy machine's other work does not inflate, beside wall-clock time.
    ck = session(store, "alone", model=model, optimizer=opt)
    tight, value = steps * 20, loss.detach()
    c0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(tight):
        ck.step(loss=value)
    alone = ((time.thread_time() - c0) / tight, (time.perf_counter() - t0) / tight)
    ck.close()

    med = statistics.median
    pairs = len(cpu["ratio"])
    print("(a) per-step overhead of ckpt.step(loss=loss), the loss a tensor, inside "
          "ckpt.epochs()/ckpt.batches() (the README's loop)")
    print(f"    sets: {', '.join(f'{k}={v}' for k, v in OFF.items())} (no commit inside a "
          "timed block); the rest at its defaults")
    print(f"    model: MLP 64-256-256-10, batch 64, SGD, {torch.get_num_threads()} thread(s); "
          f"{reps} reps x {steps} steps each way, in {pairs} pairs of {block}-step epochs")
    print("                              CPU time     wall clock   (medians)")
    print(f"    bare loop              {med(cpu['bare']) * 1e6:9.1f} us   {med(wall['bare']) * 1e6:9.1f} us"
          "   per step")
    print(f"    loop + ckpt.step       {med(cpu['session']) * 1e6:9.1f} us   "
          f"{med(wall['session']) * 1e6:9.1f} us   per step")
    print(f"    ckpt.step in the loop                {med(per_call) * 1e6:9.2f} us   per call")
    print(f"    ckpt.step alone        {alone[0] * 1e6:9.2f} us   {alone[1] * 1e6:9.2f} us   "
          "per call (loss a tensor), back to back; target <= 2 us")
    print(f"    ratio with/bare        {med(cpu['ratio']):9.4f}      {med(wall['ratio']):9.4f}"
          "      median of pair ratios; target <= 1.01")
    print(f"    ratio of summed times  {sum(cpu['session']) / sum(cpu['bare']):9.4f}      "
          f"{sum(wall['session']) / sum(wall['bare']):9.4f}")


class Decoded(torch.utils.data.Dataset):
    """Items that cost something to produce, like decoding and augmenting an image."""

    def __init__(self, n: int):
        self.n = n
        self.base = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        img = torch.roll(self.base, shifts=i % 32, dims=2)
        for _ in range(4):
            img = torch.tanh(img * 1.01 + 0.01)
        return img, i % 10


def first_batch(ds, batch_size: int, state: dict | None = None) -> float:
    """Seconds to the first batch of a fresh loader, or of one restored from `state`."""
    t0 = time.perf_counter()
    loader = ResumableLoader(ds, batch_size, seed=0, num_workers=2)
    if state is not None:
        loader.load_state_dict(state)
    it = iter(loader)
    next(it)
    dt = time.perf_counter() - t0
    del it
    return dt


def first_batch_skipping(ds, batch_size: int, position: int) -> float:
    """The naive resume: a fresh shuffled DataLoader, iterated past `position` batches."""
    t0 = time.perf_counter()
    loader = torch.utils.data.DataLoader(ds, batch_size, shuffle=True, num_workers=2,
                                         drop_last=True,
                                         generator=torch.Generator().manual_seed(0))
    it = iter(loader)
    for _ in range(position + 1):
        next(it)
    dt = time.perf_counter() - t0
    del it
    return dt


def bench_loader_resume(reps: int) -> None:
    n, batch_size = 20_000, 64
    ds = Decoded(n)
    source = ResumableLoader(ds, batch_size, seed=0)
    source.epoch, source.position = 3, source.batches_per_epoch // 2  # mid-epoch
    state = source.state_dict()
    first_batch(ds, batch_size)  # warm up (imports, first fork)
    fresh, resumed, skipping = [], [], []
    for rep in range(reps):
        runs = [lambda: fresh.append(first_batch(ds, batch_size)),
                lambda: resumed.append(first_batch(ds, batch_size, state)),
                lambda: skipping.append(first_batch_skipping(ds, batch_size, state["position"]))]
        for k in range(3):
            runs[(rep + k) % 3]()
    ratios = [r / f for r, f in zip(resumed, fresh, strict=True)]
    f, r, s = (statistics.median(v) for v in (fresh, resumed, skipping))
    print("(b) DataLoader resume: time to the first batch, 2 worker processes")
    print(f"    dataset: {n} items of 3x32x32, batch {batch_size}; restored at batch "
          f"{state['position']} of {source.batches_per_epoch} (epoch {state['epoch']}); "
          f"{reps} interleaved reps")
    print(f"    fresh start          {f * 1e3:9.1f} ms (median)")
    print(f"    resumed mid-epoch    {r * 1e3:9.1f} ms (median)")
    print(f"    naive skip-ahead     {s * 1e3:9.1f} ms (median)")
    print(f"    ratio resumed/fresh  {statistics.median(ratios):9.3f}  (median; min "
          f"{min(ratios):.3f}, max {max(ratios):.3f})  target <= 1.2")
    print(f"    ratio naive/fresh    {s / f:9.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=10, help="repetitions of (a)")
    p.add_argument("--steps", type=int, default=1000, help="training steps each way per rep in (a)")
    p.add_argument("--block", type=int, default=50, help="steps per epoch, one alternating block, in (a)")
    p.add_argument("--loader-reps", type=int, default=15, help="repetitions of (b)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    store = Path(tempfile.mkdtemp(prefix="bench-session-"))
    try:
        bench_step_overhead(args.reps, args.steps, args.block, store)
        bench_loader_resume(args.loader_reps)
    finally:
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
