"""The Lightning Trainer under `ckpt_trainer.integrations.lightning`: killed, stopped, resumed,
and ending bit for bit where an uninterrupted run ends.

`examples/lightning/train.py` (an MLP with dropout fed by a StatefulDataLoader) runs as a
real subprocess: once without interruption, and once killed with SIGKILL at a seeded step,
resumed, stopped with SIGTERM at a later seeded step, resumed to the end; each process with
a root folder of its own, so only the store carries the run. The final checkpoint's
Lightning file (weights, optimizer, scheduler, the loss history) and the generators the
session committed with it must equal the uninterrupted run's.
"""

from __future__ import annotations

import dataclasses
import io
import random
import signal
import subprocess

import pytest
import torch

from tests.standalone.test_examples_standalone import Example, latest, run_example
from tests.trainer_proc import ROOT, assert_bitwise_equal, final_state

pytest.importorskip("lightning", reason="an optional extra: pip install -e '.[lightning]'")
pytest.importorskip("torchdata", reason="an optional extra: pip install -e '.[torchdata]'")
pytestmark = pytest.mark.slow

STEPS = 60
EXAMPLE = Example(("examples/lightning/train.py", "--steps", str(STEPS)), None, None,
                  "lightning", "sine", STEPS)
HERE = ROOT / "examples" / "lightning"


def run_in(folder, **kw):
    ex = dataclasses.replace(EXAMPLE, argv=(*EXAMPLE.argv, "--root-dir", str(folder)))
    return run_example(ex, folder.parent / "store", **kw)


def lightning_state(store) -> dict:
    """What must match in the run's last checkpoint: Lightning's own file (less what names
    folders) and the generators committed with it."""
    state = final_state(store, EXAMPLE.experiment, EXAMPLE.run)
    (data,) = state["lightning"]["files"].values()
    ckpt = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)
    (losses,) = [v["losses"] for k, v in ckpt["callbacks"].items() if "CheckpointCallback" in k]
    rng = state["rng"]  # pl.seed_everything seeds Python's, NumPy's and torch's
    return {"step": ckpt["global_step"], "epoch": ckpt["epoch"], "losses": losses,
            "model": ckpt["state_dict"], "optimizer": ckpt["optimizer_states"],
            "scheduler": ckpt["lr_schedulers"], "rng": rng}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lightning-baseline")
    res = run_in(root / "out")
    assert res.returncode == 0, res.log
    assert res.committed[-1] == STEPS, res.log
    return lightning_state(root / "store")


def test_a_lightning_trainer_killed_by_sigkill_then_stopped_by_sigterm_resumes_from_the_store_to_the_uninterrupted_runs_bytes(
        uninterrupted, tmp_path):
    rng = random.Random("frameworks/lightning")
    kill_at = rng.randint(16, 29)  # after the first save (15), before the second
    term_at = rng.randint(kill_at + 1, STEPS - 2)
    gate = tmp_path / "gate"
    gate.mkdir()
    where = f"SIGKILL at step {kill_at}, SIGTERM at step {term_at}"

    killed = run_in(tmp_path / "out1", gate_at=kill_at, sig=signal.SIGKILL, gate_dir=gate)
    assert killed.returncode == -signal.SIGKILL, f"{where}\n{killed.log}"
    assert killed.committed == [15], f"{where}\n{killed.log}"
    termed = run_in(tmp_path / "out2", gate_at=term_at, sig=signal.SIGTERM, gate_dir=gate)
    assert "at step 15 " in termed.log, f"{where}\n{termed.log}"
    assert termed.returncode == 143, f"{where}\n{termed.log}"
    assert termed.committed[-1] == term_at, f"{where}\n{termed.log}"
    last = run_in(tmp_path / "out3")
    assert last.returncode == 0, f"{where}\n{last.log}"
    assert f"at step {term_at} " in last.log, f"{where}\n{last.log}"
    assert latest(tmp_path / "store", EXAMPLE)[1] == STEPS

    resumed = lightning_state(tmp_path / "store")
    assert len(resumed["losses"]) == STEPS
    assert_bitwise_equal(uninterrupted, resumed, where)


def test_the_lightning_port_changes_at_most_3_lines_of_the_original_script():
    out = subprocess.run(["diff", str(HERE / "original.py"), str(HERE / "train.py")],
                         capture_output=True, text=True, check=False).stdout
    changed = [line for line in out.splitlines() if line.startswith(("<", ">"))]
    print(f"diff examples/lightning/original.py train.py: {len(changed)} changed lines")
    assert 0 < len(changed) <= 3, out
