"""The two ports in `examples/` stay short and resume bit for bit: a word-level language
model (stateful hidden, manual lr annealing, best loss in globals) and a class-based
torchrun DDP trainer, each run as its users run it, stopped by SIGTERM at a step held by
an event (tests/standalone/test_examples_standalone.py's gate), resumed, and compared with an
uninterrupted run; a third run of the finished run trains nothing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.standalone.test_examples_standalone import Example, run_example
from tests.trainer_proc import ROOT, assert_bitwise_equal

EXAMPLES = ROOT / "examples"
# The ports' budgets of changed lines, counted as the README counts them.
BUDGETS = {"word_lm": 12, "ddp_class": 15}


def changed_lines(name: str) -> int:
    d = EXAMPLES / name
    diff = subprocess.run(["diff", "-u", d / "original.py", d / "train.py"],
                          capture_output=True, text=True).stdout
    return sum(1 for line in diff.splitlines()[2:]
               if line[:1] in "+-" and line[1:2] not in ("", "+", "-"))


@pytest.mark.slow  # runs `diff` itself: the count is the one users reproduce
@pytest.mark.parametrize("name", list(BUDGETS))
def test_each_port_changes_no_more_lines_than_its_budget(name):
    count = changed_lines(name)
    print(f"{name}: {count} changed lines")
    assert 0 < count <= BUDGETS[name]


def word_lm(tmp: Path) -> Example:
    return Example(argv=("examples/word_lm/train.py", "--save", str(tmp / "model.pt")),
                   store_flag=None, resume_flag=None, experiment="word_lm", run="word_lm",
                   steps=0, extra_args=())


def ddp_class() -> Example:
    return Example(argv=("-m", "trainer.ranks", "--nproc-per-node", "2", "--", sys.executable,
                         "examples/ddp_class/train.py", "4", "2"),
                   store_flag=None, resume_flag=None, experiment="ddp", run="ddp_class",
                   steps=32, extra_args=())


def final_parts(store: Path, ex: Example, parts: tuple[str, ...]) -> dict:
    """The parts of the run's final checkpoint, per rank file, without the generators
    the ports leave unseeded (Python's, NumPy's: they never draw from them), and without
    the best loss among the run's checkpoints: a stopped run has one checkpoint more (the
    one its stop committed), which is its best when its loss is the lowest."""
    ckdir = store / ex.experiment / ex.run / "checkpoints"
    chosen = ckdir / json.loads((ckdir / "latest.json").read_text())["checkpoint"]
    out = {}
    for f in sorted(chosen.glob("state*.pt")):
        state = torch.load(f, weights_only=True)
        for rng in (state.get("rng") or {}, (state.get("loop") or {}).get("epoch_rng") or {}):
            rng.pop("python", None)
            rng.pop("numpy", None)
        for best in ("best_score", "best_of"):
            (state.get("loop") or {}).pop(best, None)
        out[f.name] = {k: state[k] for k in parts if k in state}
    return out


def interrupted_and_resumed(ex: Example, tmp: Path, at: int) -> tuple[Path, str]:
    store = tmp / "cut"
    first = run_example(ex, store, gate_at=at, sig=signal.SIGTERM, gate_dir=tmp)
    assert first.returncode == 143, first.log
    second = run_example(ex, store)
    assert second.returncode == 0, second.log
    assert "resumed from" in second.log
    return store, second.log


@pytest.mark.slow
def test_the_word_lm_port_stopped_inside_an_epoch_resumes_to_the_uninterrupted_end(tmp_path):
    ex = word_lm(tmp_path)
    whole = run_example(ex, tmp_path / "whole")
    assert whole.returncode == 0, whole.log
    store, log = interrupted_and_resumed(ex, tmp_path, at=30)
    parts = ("model", "loop", "kept", "rng")
    assert_bitwise_equal(final_parts(store, ex, parts), final_parts(tmp_path / "whole", ex, parts))
    assert "end of training | test loss" in log
    again = run_example(ex, store)
    assert again.returncode == 0 and "already finished at step" in again.log, again.log
    assert "end of epoch" not in again.log


@pytest.mark.slow
def test_the_ddp_class_port_under_the_ranks_launcher_resumes_to_the_uninterrupted_end(tmp_path):
    ex = ddp_class()
    whole = run_example(ex, tmp_path / "whole")
    assert whole.returncode == 0, whole.log
    store, log = interrupted_and_resumed(ex, tmp_path, at=13)
    parts = ("model", "optimizer", "data", "loop", "rng")
    got = final_parts(store, ex, parts)
    assert set(got) == {"state-rank0.pt", "state-rank1.pt"}
    assert_bitwise_equal(got, final_parts(tmp_path / "whole", ex, parts))
    assert "Batchsize: 32 | Steps: 8" in log  # the tutorial's own peek at a batch
