"""torchdata's StatefulDataLoader as a part of `CheckpointSession`, worker processes included.

`examples/stateful_dataloader/train.py` runs as a real subprocess (two DataLoader workers,
shuffled, dropout): once without interruption, and once killed with SIGKILL at a seeded
step, resumed, stopped with SIGTERM at a later seeded step, resumed to the end; and once
stopped exactly at an epoch's last batch. The final checkpoint must hold exactly the bytes
of the uninterrupted run's: weights, optimizer and scheduler state, the loader's own state,
RNG states and the loss history. The signals land at a step exactly (the examples' gate).
"""

from __future__ import annotations

import signal

import pytest

from tests.frameworks.interrupted import kill_stop_finish, port_changes
from tests.standalone.test_examples_standalone import Example, latest, run_example
from tests.trainer_proc import assert_bitwise_equal, final_state

pytest.importorskip("torchdata.stateful_dataloader",
                    reason="torchdata is an optional extra: pip install -e '.[torchdata]'")
pytestmark = pytest.mark.slow

EXAMPLE = Example(("examples/stateful_dataloader/train.py", "--steps", "120"), "--store",
                  None, "sdl", "sdl", 120)
BATCHES_PER_EPOCH = 18  # 600 points in batches of 32, the last partial one dropped


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
    store = tmp_path / "store"
    # The first kill comes after the first checkpoint (25), inside an epoch.
    where = kill_stop_finish(lambda n, **kw: run_example(EXAMPLE, store, **kw),
                             "frameworks/stateful_dataloader", (30, 60), EXAMPLE.steps,
                             tmp_path / "gate")
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
    assert 0 < port_changes("stateful_dataloader") <= 6
