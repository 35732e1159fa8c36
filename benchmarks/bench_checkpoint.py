"""Checkpoint save/load cost against the raw operation on the same bytes, side by side.

For a training state of at least 1 GB (model + AdamW moments), prints:
  durable local save (serialize + hash + fsync + link) / raw write+fsync of as many bytes
  verified load (hash check + torch.load) / plain torch.load of the same file
  S3 save to a loopback moto_server / plain boto3 upload of the same bytes
and, while the same state trains (forward, backward and AdamW on it, one thread), for a
background save through `CheckpointSession(async_save=True)` (the path of every user: own
loop, task mode, command mode) and, beside it, through a bare `Checkpointer`:
  training stall per background save / synchronous durable save of the state
  training stall per background save / a plain copy of the state into host memory
  longest step while a background save is in flight / median step without one
  stall through the session / stall through the bare checkpointer

    python benchmarks/bench_checkpoint.py [--gb 1.0] [--repeats 3] [--no-s3]
                                          [--rounds 3] [--batch 16] [--no-background]
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.polling import wait_for  # noqa: E402
from trainer import CheckpointSession  # noqa: E402
from trainer.api.checkpointer import Checkpointer  # noqa: E402
from trainer.api.state_files import load_verified_state  # noqa: E402
from trainer.checkpoints.repo import CheckpointRepo  # noqa: E402
from trainer.storage import open_store  # noqa: E402


def build_state(gb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 4096
    layers = max(1, round(gb * 1e9 / (3 * 4 * width * width)))  # params + 2 AdamW moments
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(1, width)).sum().backward()
    opt.step()
    return model, opt


def raw_write_fsync(path: Path, payload: memoryview) -> float:
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for i in range(0, len(payload), 64 << 20):
            f.write(payload[i:i + (64 << 20)])
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return dt



def state_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [*model.parameters(), *(v for st in opt.state.values() for v in st.values()
                                   if isinstance(v, torch.Tensor) and v.dim() > 0)]


def plain_copy(host: list[torch.Tensor], tensors: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for dst, src in zip(host, tensors, strict=True):
        dst.copy_(src)
    return time.perf_counter() - t0


class FenceClock:
    """The training thread's wait at the optimizer's fence, timed from outside: one step
    pre-hook registered before the checkpointers' fences and one after them."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.opt, self.waited, self._t0 = opt, 0.0, 0.0
        self._hooks = [opt.register_step_pre_hook(self._start)]

    def bracket(self) -> None:
        """Call once the checkpointers exist: their fences now run between the two hooks."""
        self._hooks.append(self.opt.register_step_pre_hook(self._end))

    def take(self) -> float:
        waited, self.waited = self.waited, 0.0
        return waited

    def _start(self, *_args) -> None:
        self._t0 = time.perf_counter()

    def _end(self, *_args) -> None:
        self.waited += time.perf_counter() - self._t0

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def bench_background(model, opt, work: Path, rounds: int, batch: int, quiet_steps: int) -> None:
    """Each round, the same state and training loop: `quiet_steps` steps with no save in
    flight, then a background save through `CheckpointSession(async_save=True)` (what every
    user gets: own loop, task mode, command mode) and the steps that overlap it, then the
    same through a bare `Checkpointer`, then (side by side) a synchronous durable save and a
    plain copy of the state. A save's stall is the training thread's time in the save call
    plus its wait at the optimizer's fence in the next step, both timed here. Round 0 holds
    each path's first background save (host buffers allocated after the optimizer's first
    step): reported on its own."""
    parts = {"model": model, "optimizer": opt}
    x = torch.randn(batch, model[0].in_features)

    def train_step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
        return time.perf_counter() - t0

    def checkpointer(name: str, async_save: bool) -> Checkpointer:
        repo = CheckpointRepo(open_store(str(work / name)), "bench", name)
        repo.claim(None)
        return Checkpointer(repo, parts, 1, keep_last=1, keep_best=False, async_save=async_save)

    fence = FenceClock(opt)
    ckpt = CheckpointSession(run="session", store=str(work / "session"), resume="never",
                             install_signals=False, async_save=True, keep_last=1,
                             keep_best=False, every_steps=None, every_seconds=None,
                             on_epoch_end=False, on_best=False, heartbeat_seconds=60)
    ckpt.restore(**parts)
    bg, sync = checkpointer("direct", True), checkpointer("synchronous", False)
    fence.bracket()
    step = 0

    def background(save, in_flight) -> tuple[float, list[float]]:
        """One background save at the next step: (its stall, the steps it overlapped)."""
        nonlocal step
        step += 1
        t0 = time.perf_counter()
        train_step()
        ckpt.step(step)
        fence.take()
        s0 = time.perf_counter()
        save(step)
        call_s = time.perf_counter() - s0
        overlapping = [time.perf_counter() - t0]
        while in_flight():
            overlapping.append(train_step())
            step += 1
            ckpt.step(step)
        return call_s + fence.take(), overlapping

    tensors = state_tensors(model, opt)
    host = [torch.empty_like(t) for t in tensors]
    plain_copy(host, tensors)  # first touch: the baseline copies into warm memory
    got = {k: [] for k in ("quiet", "session", "direct", "during", "during_direct",
                           "sync", "copy")}
    first = {}
    for r in range(rounds + 1):
        steady = [train_step() for _ in range(quiet_steps)]
        for _ in steady:
            step += 1
            ckpt.step(step)
        s_stall, s_during = background(lambda _s: ckpt.save("bench"), lambda: ckpt._ck.in_flight)
        ckpt._ck.wait()
        d_stall, d_during = background(lambda s: bg.save(s, {}), lambda: bg.in_flight)
        bg.wait()
        if r == 0:
            first = {"session": (s_stall, max(s_during) / statistics.median(steady)),
                     "direct": (d_stall, max(d_during) / statistics.median(steady))}
            continue
        got["quiet"] += steady
        got["session"].append(s_stall)
        got["direct"].append(d_stall)
        got["during"] += s_during
        got["during_direct"] += d_during
        t0 = time.perf_counter()
        sync.save(step, {})
        got["sync"].append(time.perf_counter() - t0)
        got["copy"].append(plain_copy(host, tensors))
    buffers = (ckpt._ck._buffers.allocations, bg._buffers.allocations)
    bg.close()
    ckpt.close()
    fence.remove()
    report_background(first, got, sum(t.numel() * t.element_size() for t in tensors), batch,
                      buffers)


def report_background(first, got, nbytes, batch, buffers) -> None:
    med = statistics.median
    quiet = got["quiet"]
    print(f"background saves while training ({nbytes / 1e9:.2f} GB of parameters and AdamW "
          f"state, batch {batch}, {len(got['session'])} rounds after the first, medians):")
    print(f"  step without a save in flight {med(quiet):7.3f}s   host buffers allocated "
          f"{buffers[0]} through the session, {buffers[1]} direct (for all the saves)")
    for path, label in (("session", "CheckpointSession"), ("direct", "Checkpointer direct")):
        print(f"  first save, {label}: stall {first[path][0]:.4f}s, longest step "
              f"{first[path][1]:.2f}x median")

    def ratio(label, a, b, target=""):
        print(f"{label:<60} {a:8.4f}s / {b:8.4f}s  ratio {a / b:6.3f}  {target}".rstrip())

    for path, label in (("session", "CheckpointSession(async_save=True)"),
                        ("direct", "Checkpointer direct")):
        stall = med(got[path])
        print(f"{label}:")
        ratio("  stall per background save / synchronous durable save", stall,
              med(got["sync"]), "(target <= 0.1)")
        ratio("  stall per background save / plain copy to host memory", stall,
              med(got["copy"]), "(target <= 0.5)")
        during = got["during" if path == "session" else "during_direct"]
        ratio("  longest step during a save / median step", max(during), med(quiet),
              "(target <= 2)")
        ratio("  median step during a save / median step", med(during), med(quiet))
    ratio("stall through the session / stall direct", med(got["session"]), med(got["direct"]))
    ratio("  longest step without a save / median (the machine: noise)", max(quiet), med(quiet))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            urllib.request.urlopen(url, timeout=0.5)
        except urllib.error.HTTPError:
            return True  # any HTTP answer means the server is up
        except Exception:
            return False
        return True

    wait_for(answers, 30, 0.1, f"moto_server to answer on {url}")
    return proc, url


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--no-background", action="store_true")
    p.add_argument("--rounds", type=int, default=3, help="background saves measured")
    p.add_argument("--batch", type=int, default=16, help="training batch (background saves)")
    p.add_argument("--quiet-steps", type=int, default=3,
                   help="steps without a save in flight before each background save")
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)  # the session's own lines stay out of the figures

    model, opt = build_state(args.gb)
    parts = {"model": model, "optimizer": opt}
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=os.environ.get("BENCH_DIR")))
    repo = CheckpointRepo(open_store(str(work / "store")), "bench", "save")
    ck = Checkpointer(repo, parts, attempt=1, keep_last=1, keep_best=False)

    ours_save, raw_save, ours_load, plain_load = [], [], [], []
    nbytes = None
    for r in range(args.repeats):
        t0 = time.perf_counter()
        ck.save(step=r + 1, meta={})
        ours_save.append(time.perf_counter() - t0)
        manifest = repo.verify(repo.read_pointer().checkpoint)
        nbytes = manifest.total_size
        path = work / "store" / repo.key(manifest.name, "state.pt")
        payload = memoryview(path.read_bytes())
        raw_save.append(raw_write_fsync(work / "raw.bin", payload))
        del payload

        t0 = time.perf_counter()
        state = load_verified_state(repo, manifest)
        ours_load.append(time.perf_counter() - t0)
        del state
        t0 = time.perf_counter()
        state = torch.load(path, map_location="cpu", weights_only=True)
        plain_load.append(time.perf_counter() - t0)
        del state

    def line(label, ours, base):
        mo, mb = statistics.median(ours), statistics.median(base)
        print(f"{label:<44} ours {mo:7.3f}s  baseline {mb:7.3f}s  ratio {mo / mb:5.2f}")

    print(f"training state: {nbytes / 1e9:.2f} GB ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
          f"params + AdamW), {args.repeats} repeats, medians")
    line("durable local save / raw write+fsync", ours_save, raw_save)
    line("verified load / plain torch.load", ours_load, plain_load)

    if not args.no_s3:
        proc, url = start_moto()
        try:
            os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="bench",
                              AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
            import boto3
            from boto3.s3.transfer import TransferConfig

            client = boto3.client("s3")
            client.create_bucket(Bucket="bench")
            s3repo = CheckpointRepo(open_store("s3://bench/ours"), "bench", "save")
            s3ck = Checkpointer(s3repo, parts, attempt=1, keep_last=1, keep_best=False)
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
            data = buf.getvalue()
            del buf
            cfg = TransferConfig(multipart_chunksize=64 << 20, max_concurrency=4)
            ours_s3, plain_s3 = [], []
            for r in range(args.repeats):
                t0 = time.perf_counter()
                s3ck.save(step=r + 1, meta={})
                ours_s3.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                client.upload_fileobj(io.BytesIO(data), "bench", f"plain/{r}", Config=cfg)
                plain_s3.append(time.perf_counter() - t0)
                client.delete_object(Bucket="bench", Key=f"plain/{r}")
            line("S3 save (loopback) / boto3 multipart upload", ours_s3, plain_s3)
        finally:
            proc.terminate()
            proc.wait()
    if not args.no_background:
        bench_background(model, opt, work, args.rounds, args.batch, args.quiet_steps)
    subprocess.run(["rm", "-rf", str(work)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
