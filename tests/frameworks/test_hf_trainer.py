"""The Hugging Face Trainer under `ckpt_trainer.integrations.hf`: killed, stopped, resumed, and
ending bit for bit where an uninterrupted run ends.

`examples/hf_trainer/train.py` (a two-layer GPT-2 built from a config) runs as a real
subprocess: once without interruption, and once killed with SIGKILL at a seeded step,
resumed, stopped with SIGTERM at a later seeded step, resumed to the end; each process with
an output folder of its own, as on a new machine, so only the store carries the run. The
final checkpoint's Trainer files (weights, optimizer, scheduler, RNG states, the log
history) must equal the uninterrupted run's. The signals land at a step exactly (the
examples' gate holds the process in the callback's "step N done" line).
"""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import pytest
import torch

from tests.frameworks.interrupted import kill_stop_finish, port_changes
from tests.standalone.test_examples_standalone import Example, latest, run_example
from tests.trainer_proc import assert_bitwise_equal, final_state

pytest.importorskip("transformers", reason="an optional extra: pip install -e '.[hf]'")
pytestmark = pytest.mark.slow

STEPS = 60
EXAMPLE = Example(("examples/hf_trainer/train.py", "--steps", str(STEPS)), None, None, "hf",
                  "tiny-gpt2", STEPS)
# Files whose bytes are the training state; training_args.bin names the output folder.
STATE_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth")


def run_in(folder, **kw):
    ex = dataclasses.replace(EXAMPLE, argv=(*EXAMPLE.argv, "--output-dir", str(folder)))
    return run_example(ex, folder.parent / "store", **kw)


def trainer_files(store, experiment: str = EXAMPLE.experiment, run: str = EXAMPLE.run) -> dict:
    """The Trainer's files in the run's last checkpoint: the training state's bytes, and the
    log history (less the run's summary line of wall-clock figures)."""
    part = final_state(store, experiment, run)["hf_trainer"]
    files = {rel.split("/", 1)[1]: t.numpy().tobytes() for rel, t in part["files"].items()}
    state = json.loads(files["trainer_state.json"])
    history = [e for e in state["log_history"] if "train_runtime" not in e]
    loaded = {name: tensors(torch.load(io.BytesIO(files[name]), weights_only=False))
              for name in STATE_FILES if name != "model.safetensors"}
    return {"step": part["step"], "global_step": state["global_step"], "history": history,
            "model": files["model.safetensors"], **loaded}


def tensors(value):
    """NumPy arrays (NumPy's generator state) as tensors, to compare bit for bit."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    if isinstance(value, dict):
        return {k: tensors(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [tensors(v) for v in value]
    return value


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf-baseline")
    res = run_in(root / "out")
    assert res.returncode == 0, res.log
    assert res.committed[-1] == STEPS, res.log
    return trainer_files(root / "store")


def test_a_hf_trainer_killed_by_sigkill_then_stopped_by_sigterm_resumes_from_the_store_to_the_uninterrupted_runs_bytes(
        uninterrupted, tmp_path):
    where = kill_stop_finish(lambda n, **kw: run_in(tmp_path / f"out{n}", **kw),
                             "frameworks/hf_trainer", (16, 29), STEPS, tmp_path / "gate")
    assert latest(tmp_path / "store", EXAMPLE)[1] == STEPS

    resumed = trainer_files(tmp_path / "store")
    assert len(resumed["history"]) == STEPS, resumed["history"]
    assert_bitwise_equal(uninterrupted, resumed, where)


def test_the_hf_trainer_port_changes_at_most_3_lines_of_the_original_script():
    assert 0 < port_changes("hf_trainer") <= 3
