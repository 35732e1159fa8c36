"""Checkpoint save/load cost against the raw operation on the same bytes, side by side.

For a training state of at least 1 GB (model + AdamW moments), prints:
  durable local save (serialize + hash + fsync + link) / raw write+fsync of as many bytes
  verified load (hash check + torch.load) / plain torch.load of the same file
  S3 save to a loopback moto_server / plain boto3 upload of the same bytes

    python benchmarks/bench_checkpoint.py [--gb 1.0] [--repeats 3] [--no-s3]
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
    subprocess.run(["rm", "-rf", str(work)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
