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

import pytest
import torch

from tests.frameworks.interrupted import kill_stop_finish, port_changes
from tests.standalone.test_examples_standalone import Example, latest, run_example
from tests.trainer_proc import assert_bitwise_equal, final_state

pytest.importorskip("lightning", reason="an optional extra: pip install -e '.[lightning]'")
pytest.importorskip("torchdata", reason="an optional extra: pip install -e '.[torchdata]'")
pytestmark = pytest.mark.slow

STEPS = 60
EXAMPLE = Example(("examples/lightning/train.py", "--steps", str(STEPS)), None, None,
                  "lightning", "sine", STEPS)


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
    where = kill_stop_finish(lambda n, **kw: run_in(tmp_path / f"out{n}", **kw),
                             "frameworks/lightning", (16, 29), STEPS, tmp_path / "gate")
    assert latest(tmp_path / "store", EXAMPLE)[1] == STEPS

    resumed = lightning_state(tmp_path / "store")
    assert len(resumed["losses"]) == STEPS
    assert_bitwise_equal(uninterrupted, resumed, where)


def test_the_lightning_port_changes_at_most_3_lines_of_the_original_script():
    assert 0 < port_changes("lightning") <= 3
