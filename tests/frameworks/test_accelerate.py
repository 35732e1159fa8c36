"""Accelerate's own loop with `CheckpointSession`: the objects `accelerator.prepare` returns
are the parts, and the run resumes bit for bit.

`examples/accelerate/train.py` runs as a real subprocess: once without interruption, and
once killed with SIGKILL at a seeded step, resumed, stopped with SIGTERM at a later seeded
step, resumed to the end. The final checkpoint (weights, the prepared optimizer's and
scheduler's state, the loader's position, RNG states, loss history) must hold exactly the
uninterrupted run's bytes. The signals land at a step exactly (the examples' gate).
"""

from __future__ import annotations

import pytest

from tests.frameworks.interrupted import kill_stop_finish, port_changes
from tests.standalone.test_examples_standalone import Example, latest, run_example
from tests.trainer_proc import assert_bitwise_equal, final_state

pytest.importorskip("accelerate", reason="an optional extra: pip install -e '.[accelerate]'")
pytestmark = pytest.mark.slow

EXAMPLE = Example(("examples/accelerate/train.py", "--steps", "90"), "--store", None,
                  "accelerate", "sine", 90)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    store = tmp_path_factory.mktemp("accelerate-baseline") / "store"
    res = run_example(EXAMPLE, store)
    assert res.returncode == 0, res.log
    assert res.committed[-1] == EXAMPLE.steps, res.log
    return final_state(store, EXAMPLE.experiment, EXAMPLE.run)


def test_an_accelerate_loop_killed_by_sigkill_then_sigterm_resumes_to_the_uninterrupted_runs_bytes(
        uninterrupted, tmp_path):
    store = tmp_path / "store"
    # The first kill comes after the first checkpoint (25).
    where = kill_stop_finish(lambda n, **kw: run_example(EXAMPLE, store, **kw),
                             "frameworks/accelerate", (30, 60), EXAMPLE.steps, tmp_path / "gate")
    assert latest(store, EXAMPLE)[1] == EXAMPLE.steps

    assert_bitwise_equal(uninterrupted, final_state(store, EXAMPLE.experiment, EXAMPLE.run), where)


def test_the_accelerate_port_changes_at_most_8_lines_of_the_original_script():
    assert 0 < port_changes("accelerate") <= 8
