"""Checkpoint save/load cost against the raw operation on the same bytes, side by side.

For a training state of at least 1 GB (model + AdamW moments), prints:
  durable local save (serialize + hash + fsync + link) / raw write+fsync of as many bytes
  verified load (hash check + torch.load) / plain torch.load of the same file
  S3 save to a loopback moto_server / plain boto3 upload of the same bytes
and, while the same state trains (forward, backward and AdamW on it, one thread):
  training stall per background save (`async_save`) / synchronous durable save of the state
  training stall per background save / a plain copy of the state into host memory
  longest step while a background save is in flight / median step without one

    python benchmarks/bench_checkpoint.py [--gb 1.0] [--repeats 3] [--no-s3]
                                          [--rounds 3] [--batch 16] [--no-background]
"""

from __future__ import annotations

import argparse
import io
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
from trainer.checkpointer import Checkpointer, load_verified_state  # noqa: E402
from trainer.repo import CheckpointRepo  # noqa: E402
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


def bench_background(model, opt, work: Path, rounds: int, batch: int, quiet_steps: int) -> None:
    """Each round: `quiet_steps` training steps with no save in flight, then a background
    save and the steps that overlap it, then (side by side) a synchronous durable save and a
    plain copy of the same state. Round 0 is the first background save (the host buffers
    were allocated after the optimizer's first step): reported on its own."""
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

    bg, sync = checkpointer("background", True), checkpointer("synchronous", False)
    committed: list[dict] = []
    bg.on_commit = lambda _m, stats: committed.append(stats)
    tensors = state_tensors(model, opt)
    host = [torch.empty_like(t) for t in tensors]
    plain_copy(host, tensors)  # first touch: the baseline copies into warm memory
    quiet, during, stalls, sync_s, copy_s, writes = [], [], [], [], [], []
    step, first = 0, None
    for r in range(rounds + 1):
        steady = [train_step() for _ in range(quiet_steps)]
        step += quiet_steps + 1
        t0 = time.perf_counter()
        train_step()
        bg.save(step, {})
        overlapping = [time.perf_counter() - t0]
        while bg.in_flight:
            overlapping.append(train_step())
            step += 1
        bg.wait()
        if r == 0:
            first = (committed[-1]["blocking_seconds"], max(overlapping) / statistics.median(steady))
            continue
        quiet += steady
        during += overlapping
        stalls.append(committed[-1]["blocking_seconds"])
        writes.append(committed[-1]["write_seconds"])
        t0 = time.perf_counter()
        sync.save(step, {})
        sync_s.append(time.perf_counter() - t0)
        copy_s.append(plain_copy(host, tensors))
    bg.close()
    report_background(first, quiet, during, stalls, sync_s, copy_s, writes,
                      sum(t.numel() * t.element_size() for t in tensors), batch,
                      bg._buffers.allocations)


def report_background(first, quiet, during, stalls, sync_s, copy_s, writes, nbytes, batch,
                      allocations) -> None:
    med = statistics.median
    print(f"background saves while training ({nbytes / 1e9:.2f} GB of parameters and AdamW "
          f"state, batch {batch}, {len(stalls)} rounds after the first, medians):")
    print(f"  step without a save in flight {med(quiet):7.3f}s   background write "
          f"{med(writes):7.3f}s   host buffers allocated {allocations} (for all the saves)")
    print(f"  first save: stall {first[0]:.4f}s, longest step {first[1]:.2f}x median")
    print(f"{'stall per background save / synchronous durable save':<56} "
          f"{med(stalls):8.4f}s / {med(sync_s):7.3f}s  ratio {med(stalls) / med(sync_s):6.3f}"
          "  (target <= 0.1)")
    print(f"{'stall per background save / plain copy to host memory':<56} "
          f"{med(stalls):8.4f}s / {med(copy_s):7.3f}s  ratio {med(stalls) / med(copy_s):6.3f}"
          "  (target <= 0.5)")
    print(f"{'longest step during a save / median step':<56} "
          f"{max(during):8.3f}s / {med(quiet):7.3f}s  ratio {max(during) / med(quiet):6.3f}"
          "  (target <= 2)")
    print(f"{'  the same without a save (the machine: noise)':<56} "
          f"{max(quiet):8.3f}s / {med(quiet):7.3f}s  ratio {max(quiet) / med(quiet):6.3f}")
    print(f"{'  median step during a save / median step':<56} "
          f"{med(during):8.3f}s / {med(quiet):7.3f}s  ratio {med(during) / med(quiet):6.3f}")


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
