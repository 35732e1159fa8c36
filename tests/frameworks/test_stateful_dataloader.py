"""torchdata's StatefulDataLoader as a part of `CheckpointSession`, worker processes included.

`examples/stateful_dataloader/train.py` runs as a real subprocess (two DataLoader workers,
shuffled, dropout): once without interruption, and once killed with SIGKILL at a seeded
step, resumed, stopped with SIGTERM at a later seeded step, resumed to the end; and once
stopped exactly at an epoch's last batch. The final checkpoint must hold exactly the bytes
of the uninterrupted run's: weights, optimizer and scheduler state, the loader's own state,
RNG states and the loss history. The signals land at a step exactly (the examples' gate).
"""

from __future__ import annotations

import random
import signal
import subprocess

import pytest

from tests.standalone.test_examples_standalone import Example, latest, run_example
from tests.trainer_proc import ROOT, assert_bitwise_equal, final_state

pytest.importorskip("torchdata.stateful_dataloader",
                    reason="torchdata is an optional extra: pip install -e '.[torchdata]'")
pytestmark = pytest.mark.slow

EXAMPLE = Example(("examples/stateful_dataloader/train.py", "--steps", "120"), "--store",
                  None, "sdl", "sdl", 120)
BATCHES_PER_EPOCH = 18  # 600 points in batches of 32, the last partial one dropped
HERE = ROOT / "examples" / "stateful_dataloader"


def final(store) -> dict:
    """The run's last checkpoint, less the generators the script never seeds nor draws from
    (Python's and NumPy's: each fresh process starts them elsewhere)."""
    state = final_state(store, EXAMPLE.experiment, EXAMPLE.run)
    for name in ("python", "numpy"):
        state["rng"].pop(name)
    return state


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    store = tmp_path_factory.mktemp("sdl-baseline") / "store"
    res = run_example(EXAMPLE, store)
    assert res.returncode == 0, res.log
    assert res.committed[-1] == EXAMPLE.steps, res.log
    return final(store)


def test_a_statefuldataloader_with_workers_killed_by_sigkill_then_sigterm_resumes_to_the_uninterrupted_runs_bytes(
        uninterrupted, tmp_path):
    rng = random.Random("frameworks/stateful_dataloader")
    kill_at = rng.randint(30, 60)  # after the first checkpoint (25), inside an epoch
    term_at = rng.randint(kill_at + 1, EXAMPLE.steps - 2)
    store, gate = tmp_path / "store", tmp_path / "gate"
    gate.mkdir()
    where = f"SIGKILL at step {kill_at}, SIGTERM at step {term_at}"

    killed = run_example(EXAMPLE, store, gate_at=kill_at, sig=signal.SIGKILL, gate_dir=gate)
    assert killed.returncode == -signal.SIGKILL, f"{where}\n{killed.log}"
    termed = run_example(EXAMPLE, store, gate_at=term_at, sig=signal.SIGTERM, gate_dir=gate)
    assert f"at step {killed.committed[-1]} " in termed.log, f"{where}\n{termed.log}"
    assert termed.returncode == 143 and termed.committed[-1] == term_at, f"{where}\n{termed.log}"
    last = run_example(EXAMPLE, store)
    assert last.returncode == 0, f"{where}\n{last.log}"
    assert latest(store, EXAMPLE)[1] == EXAMPLE.steps

    assert_bitwise_equal(uninterrupted, final(store), where)


def test_a_statefuldataloader_stopped_at_an_epochs_last_batch_resumes_with_the_next_epochs_first_batch(
        uninterrupted, tmp_path):
    """Committed after the epoch's last batch, before the loader ran out: the resumed `for`
    ends that epoch at once and the next one draws the order the uninterrupted run drew."""
    store, gate = tmp_path / "store", tmp_path / "gate"
    gate.mkdir()
    boundary = 2 * BATCHES_PER_EPOCH
    termed = run_example(EXAMPLE, store, gate_at=boundary, sig=signal.SIGTERM, gate_dir=gate)
    assert termed.returncode == 143 and termed.committed[-1] == boundary, termed.log
    last = run_example(EXAMPLE, store)
    assert last.returncode == 0 and f"at step {boundary} " in last.log, last.log
    assert_bitwise_equal(uninterrupted, final(store), f"SIGTERM at step {boundary}")


def test_the_statefuldataloader_port_changes_at_most_6_lines_of_the_original_script():
    out = subprocess.run(["diff", str(HERE / "original.py"), str(HERE / "train.py")],
                         capture_output=True, text=True, check=False).stdout
    changed = [line for line in out.splitlines() if line.startswith(("<", ">"))]
    print(f"diff examples/stateful_dataloader/original.py train.py: {len(changed)} changed lines")
    assert 0 < len(changed) <= 6, out
