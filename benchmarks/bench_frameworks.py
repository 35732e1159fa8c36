"""What a framework's own resume leaves inexact, measured side by side in one run.

The frameworks' examples (`examples/hf_trainer/`, `examples/lightning/`) resume bit for bit
(tests/frameworks/). Each variant below changes one thing a user may well write, which the
framework's own resume does not carry across a stop, and measures what differs between an
uninterrupted run and the same run stopped with SIGTERM at step `--stop-at` and resumed from
the store:

(a) Hugging Face Trainer with `logging_steps=5`: the Trainer's running loss restarts at zero
    on a resume, so the log entry that spans the stop averages only the resumed steps.
    Printed: the log entries that differ, the largest difference, and whether weights and
    optimizer state are still bitwise equal.
(b) Lightning with a plain `DataLoader` in place of the `StatefulDataLoader`: Lightning has
    no position to restore for it, so the resumed epoch's batches are not the interrupted
    one's. Printed: the steps whose loss differs and the largest weight difference.

    python benchmarks/bench_frameworks.py [--stop-at 23]

The signal is sent when the trainer logs that step as done, so the committed step may be a
step later on a busy machine; it is printed.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DONE = re.compile(r"step (\d+) done")
COMMITTED = re.compile(r"checkpoint committed: step (\d+)")


def run(script: Path, args: list[str], store: Path, stop_at: int | None = None) -> int | None:
    """Run `script` to its end, or stop it with SIGTERM once step `stop_at` is done; the last
    committed step of a stopped run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "DAGSTER_"))}
    env.update(PYTHONPATH=str(ROOT), CKPT_STORE_URI=str(store))
    proc = subprocess.Popen([sys.executable, str(script), *args, "--log-level", "DEBUG"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    sent, committed = False, None
    for line in proc.stdout:
        if stop_at is not None and not sent and (m := DONE.search(line)) \
                and int(m.group(1)) >= stop_at:
            proc.send_signal(signal.SIGTERM)
            sent = True
        if m := COMMITTED.search(line):
            committed = int(m.group(1))
    code = proc.wait()
    want = 143 if stop_at is not None else 0
    if code != want:
        raise SystemExit(f"{script.name} {' '.join(args)} exited {code}, not {want}")
    return committed


def variant(example: str, old: str, new: str, work: Path) -> Path:
    src = (ROOT / "examples" / example / "train.py").read_text()
    if old not in src:
        raise SystemExit(f"examples/{example}/train.py no longer has {old!r}; update this benchmark")
    path = work / f"{example}_variant.py"
    path.write_text(src.replace(old, new))
    return path


def last_files(store: Path, experiment: str, run: str, part: str) -> dict[str, bytes]:
    ckdir = store / experiment / run / "checkpoints"
    name = json.loads((ckdir / "latest.json").read_text())["checkpoint"]
    state = torch.load(ckdir / name / "state.pt", weights_only=True)[part]
    return {rel.split("/")[-1]: t.numpy().tobytes() for rel, t in state["files"].items()}


def both(script: Path, args: list[str], out_flag: str, work: Path, tag: str, stop_at: int):
    """(uninterrupted store, stopped-and-resumed store, the step the stop committed); each
    process with an output folder of its own (`out_flag`)."""
    base, resumed = work / f"{tag}-base", work / f"{tag}-resumed"
    run(script, [*args, out_flag, str(work / f"{tag}-o1")], base)
    stopped = run(script, [*args, out_flag, str(work / f"{tag}-o2")], resumed, stop_at)
    run(script, [*args, out_flag, str(work / f"{tag}-o3")], resumed)
    return base, resumed, stopped


def hf(work: Path, stop_at: int) -> None:
    script = variant("hf_trainer", "logging_steps=1", "logging_steps=5", work)
    base, resumed, stopped = both(script, ["--steps", "60"], "--output-dir", work, "hf", stop_at)
    a, b = (last_files(s, "hf", "tiny-gpt2", "hf_trainer") for s in (base, resumed))
    logs = [[e for e in json.loads(f["trainer_state.json"])["log_history"] if "loss" in e]
            for f in (a, b)]
    differ = [(x["step"], x["loss"], y["loss"]) for x, y in zip(*logs, strict=True)
              if x["loss"] != y["loss"]]
    same = a["model.safetensors"] == b["model.safetensors"]
    opt = [torch.load(io.BytesIO(f["optimizer.pt"]), weights_only=True) for f in (a, b)]
    same_opt = all(torch.equal(x, y) for x, y in zip(_tensors(opt[0]), _tensors(opt[1]),
                                                     strict=True))
    print(f"(a) HF Trainer, logging_steps=5, SIGTERM committed step {stopped}: "
          f"{len(differ)} of {len(logs[0])} logged losses differ "
          f"{[(s, round(x, 4), round(y, 4)) for s, x, y in differ]}; "
          f"max |d loss| {max((abs(x - y) for _, x, y in differ), default=0):.4g}; "
          f"weights bitwise equal: {same}; optimizer bitwise equal: {same_opt}")


def lightning(work: Path, stop_at: int) -> None:
    script = variant("lightning", "loader = StatefulDataLoader(",
                     "loader = torch.utils.data.DataLoader(", work)
    base, resumed, stopped = both(script, ["--steps", "60"], "--root-dir", work, "lightning",
                                   stop_at)
    a, b = (torch.load(io.BytesIO(next(iter(last_files(s, "lightning", "sine", "lightning")
                                             .values()))), weights_only=False)
            for s in (base, resumed))
    la, lb = ([v["losses"] for k, v in c["callbacks"].items() if "CheckpointCallback" in k][0]
              for c in (a, b))
    first = next((i + 1 for i, (x, y) in enumerate(zip(la, lb, strict=True)) if x != y), None)
    dw = max((x - y).abs().max().item() for x, y in zip(a["state_dict"].values(),
                                                       b["state_dict"].values(), strict=True))
    print(f"(b) Lightning, plain DataLoader, SIGTERM committed step {stopped}: "
          f"{sum(x != y for x, y in zip(la, lb, strict=True))} of {len(la)} step losses "
          f"differ, the first at step {first}; max |d weight| {dw:.4g}")


def _tensors(state) -> list[torch.Tensor]:
    out, stack = [], [state]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            stack.extend(x[k] for k in sorted(x, key=str))
        elif isinstance(x, list | tuple):
            stack.extend(x)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stop-at", type=int, default=23)
    args = p.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        hf(Path(tmp), args.stop_at)
        lightning(Path(tmp), args.stop_at)


if __name__ == "__main__":
    main()
