"""Accelerate's own loop with `CheckpointSession`: the objects `accelerator.prepare` returns
are the parts, and the run resumes bit for bit.

`examples/accelerate/train.py` runs as a real subprocess: once without interruption, and
once killed with SIGKILL at a seeded step, resumed, stopped with SIGTERM at a later seeded
step, resumed to the end. The final checkpoint (weights, the prepared optimizer's and
scheduler's state, the loader's position, RNG states, loss history) must hold exactly the
uninterrupted run's bytes. The signals land at a step exactly (the examples' gate).
"""

from __future__ import annotations

import random
import signal
import subprocess

import pytest

from tests.standalone.test_examples_standalone import Example, latest, run_example
from tests.trainer_proc import ROOT, assert_bitwise_equal, final_state

pytest.importorskip("accelerate", reason="an optional extra: pip install -e '.[accelerate]'")
pytestmark = pytest.mark.slow

EXAMPLE = Example(("examples/accelerate/train.py", "--steps", "90"), "--store", None,
                  "accelerate", "sine", 90)
HERE = ROOT / "examples" / "accelerate"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    store = tmp_path_factory.mktemp("accelerate-baseline") / "store"
    res = run_example(EXAMPLE, store)
    assert res.returncode == 0, res.log
    assert res.committed[-1] == EXAMPLE.steps, res.log
    return final_state(store, EXAMPLE.experiment, EXAMPLE.run)


def test_an_accelerate_loop_killed_by_sigkill_then_sigterm_resumes_to_the_uninterrupted_runs_bytes(
        uninterrupted, tmp_path):
    rng = random.Random("frameworks/accelerate")
    kill_at = rng.randint(30, 60)  # after the first checkpoint (25)
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

    assert_bitwise_equal(uninterrupted, final_state(store, EXAMPLE.experiment, EXAMPLE.run), where)


def test_the_accelerate_port_changes_at_most_8_lines_of_the_original_script():
    out = subprocess.run(["diff", str(HERE / "original.py"), str(HERE / "train.py")],
                         capture_output=True, text=True, check=False).stdout
    changed = [line for line in out.splitlines() if line.startswith(("<", ">"))]
    print(f"diff examples/accelerate/original.py train.py: {len(changed)} changed lines")
    assert 0 < len(changed) <= 8, out
