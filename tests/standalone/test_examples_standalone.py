"""The examples, run the way their users run them, resume bit for bit.

Each example runs as a real subprocess: once without interruption, and once killed with
SIGKILL at a seeded random step, resumed, stopped with SIGTERM at a later seeded random
step, and resumed again to the end. The final checkpoint of the interrupted run must hold
exactly the bytes of tensors, optimizer state, data position, RNG states and loss history
of the example_baseline one.

The signal is timed by an event, not by a guess: a `sitecustomize` module put on the
child's PYTHONPATH holds the child inside its "step N done" log call (at DEBUG, which it
turns on for the `trainer` logger with a filter, not a handler, so that a script without
logging configuration stays without) until the test has sent the signal and closed the
child's stdin. So the signal lands at step N exactly, on a fast or a slow machine alike.

`examples/no_block` is a script ported to the session without a `with` block: the test
counts the lines its port changed, and kills it exactly at an epoch boundary to check that
the end-of-epoch evaluation and LR decision of that epoch run once, after the resume.
"""

from __future__ import annotations

import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.trainer_proc import COMMIT_RE, ROOT, Result, assert_bitwise_equal, final_state
from trainer.process.contract import Env

pytestmark = pytest.mark.slow

GATE_RE = re.compile(r"GATE step (\d+)")
GATE_MODULE = '''\
import logging, os, re, sys

_AT = int(os.environ["EXAMPLES_GATE_STEP"])


class _Gate(logging.Filter):
    """Hold the process inside the log call of step _AT until stdin closes."""

    def filter(self, record):
        m = re.match(r"step (\\d+) done", record.getMessage())
        if m and int(m.group(1)) == _AT:
            os.write(2, f"GATE step {_AT}\\n".encode())
            sys.stdin.buffer.read()
        return True


_trainer = logging.getLogger("trainer")
_trainer.addFilter(_Gate())
_trainer.setLevel(logging.DEBUG)
'''


@dataclass(frozen=True)
class Example:
    argv: tuple[str, ...]  # after the interpreter, before the store and resume arguments
    store_flag: str | None  # None: the store is named by $CKPT_STORE_URI
    resume_flag: str | None  # how to name the checkpoint to continue from (None: the env)
    experiment: str
    run: str
    steps: int
    pythonpath: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ("--log-level", "DEBUG")
    env: tuple[tuple[str, str], ...] = ()
    # Generators the script never seeds (and never draws from): each fresh process starts
    # them elsewhere, so they are left out of the comparison.
    unseeded: tuple[str, ...] = ()


EXAMPLES = {
    "digits": Example(
        ("examples/digits/train.py", "--steps", "120", "--run", "digits"), "--store",
        "--resume-from", "digits", "digits", 120),
    "char_lm": Example(
        ("-m", "trainer", "--config", "examples/char_lm/config.yaml"), "--store", "--resume",
        "examples", "char-lm", 150, pythonpath=("examples/char_lm",)),
    "plain_script": Example(
        ("examples/plain_script/train.py", "--steps", "150"), "--store", "--resume-from",
        "plain", "plain", 150),
    # No logging configured, no flags of ours: store and resume point by environment.
    "no_block": Example(
        ("examples/no_block/train.py",), None, None, "spirals", "spirals", 192,
        extra_args=(), env=(("OMP_NUM_THREADS", "1"),), unseeded=("python", "numpy")),
}
NO_BLOCK = ROOT / "examples" / "no_block"
BATCHES_PER_EPOCH = 32  # examples/no_block: 2048 points in batches of 64


def run_example(ex: Example, store: Path, *, resume: str | None = None,
                gate_at: int | None = None, sig: int | None = None,
                gate_dir: Path | None = None, timeout: float = 300) -> Result:
    """Run the example to its end, or, with `gate_at`, send `sig` when step `gate_at` is done;
    `resume` names the checkpoint to continue from, the way the example takes it."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CKPT_", "DAGSTER_PIPES")) and k != "CHECKPOINT_PATH"}
    env.update(ex.env)
    paths = [str(ROOT / p) for p in ex.pythonpath] + [str(ROOT)]
    if gate_at is not None:
        (gate_dir / "sitecustomize.py").write_text(GATE_MODULE)
        paths.insert(0, str(gate_dir))
        env["EXAMPLES_GATE_STEP"] = str(gate_at)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    argv = [sys.executable, *ex.argv, *ex.extra_args]
    if ex.store_flag:
        argv += [ex.store_flag, str(store)]
    else:
        env[Env.STORE_URI] = str(store)
    if resume and ex.resume_flag:
        argv += [ex.resume_flag, resume]
    elif resume:
        env[Env.RESUME_FROM] = resume
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    out, fd, signalled = bytearray(), proc.stdout.fileno(), False
    deadline = time.monotonic() + timeout
    try:
        while True:
            exited = proc.poll() is not None
            # DataLoader workers hold the pipe open for a few seconds after the main process
            # is killed: once it has exited, whatever is not already in the pipe never comes.
            ready, _, _ = select.select([fd], [], [], 0 if exited else 0.5)
            chunk = os.read(fd, 1 << 16) if ready else b""
            if not chunk and (exited or ready):
                break
            out += chunk
            if gate_at is not None and not signalled and GATE_RE.search(out.decode(errors="replace")):
                proc.send_signal(sig)
                proc.stdin.close()  # releases the held step once the signal is pending
                signalled = True
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"{argv} ran past {timeout}s:\n{out.decode(errors='replace')}")
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        if not proc.stdin.closed:
            proc.stdin.close()
    log = out.decode(errors="replace")
    if gate_at is not None:
        assert signalled, f"step {gate_at} was never reached:\n{log}"
    return Result(proc.returncode, log, [int(m) for m in COMMIT_RE.findall(log)])


def latest(store: Path, ex: Example) -> tuple[str, int]:
    """The URI and step of the checkpoint latest.json names."""
    ckdir = store / ex.experiment / ex.run / "checkpoints"
    name = json.loads((ckdir / "latest.json").read_text())["checkpoint"]
    return f"file://{ckdir / name}", int(name.split("-")[1])


def final(store: Path, ex: Example) -> dict:
    state = final_state(store, ex.experiment, ex.run)
    for rng in (state["rng"], state["loop"].get("epoch_rng") or {}):
        for name in ex.unseeded:
            rng.pop(name)
    return state


@pytest.fixture(scope="module")
def example_baseline(tmp_path_factory):
    """The final checkpoint of each example's example_baseline run, run once per module."""
    done: dict[str, tuple[Result, dict]] = {}

    def get(name: str) -> tuple[Result, dict]:
        if name not in done:
            store = tmp_path_factory.mktemp(f"{name}-baseline") / "store"
            res = run_example(EXAMPLES[name], store)
            assert res.returncode == 0, res.log
            assert latest(store, EXAMPLES[name])[1] == EXAMPLES[name].steps, res.log
            done[name] = (res, final(store, EXAMPLES[name]))
        return done[name]

    return get


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_an_uninterrupted_run_exits_0_with_its_last_step_committed_and_every_loss_recorded(name, example_baseline):
    ex = EXAMPLES[name]
    res, state = example_baseline(name)
    assert "from scratch" in res.log
    assert res.committed[-1] == ex.steps
    assert state["loop"]["step"] == ex.steps
    assert len(state["loop"]["losses"]) == ex.steps


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_sigkill_then_sigterm_at_random_steps_then_resume_ends_bitwise_identical_and_sigterm_exits_143_having_committed_its_step(
        name, example_baseline, tmp_path):
    ex = EXAMPLES[name]
    rng = random.Random(f"examples/{name}")
    kill_at = rng.randint(25, ex.steps // 2)  # after the first checkpoint, between others
    term_at = rng.randint(kill_at + 1, ex.steps - 2)
    store, gate = tmp_path / "store", tmp_path / "gate"
    gate.mkdir()
    where = f"{name}: SIGKILL at step {kill_at}, SIGTERM at step {term_at}"

    killed = run_example(ex, store, gate_at=kill_at, sig=signal.SIGKILL, gate_dir=gate)
    assert killed.returncode == -signal.SIGKILL, f"{where}\n{killed.log}"
    assert killed.committed and killed.committed[-1] < kill_at, f"{where}\n{killed.log}"
    before_kill = killed.committed[-1]

    # Resumed by discovery (no checkpoint named): the newest one that verifies.
    termed = run_example(ex, store, gate_at=term_at, sig=signal.SIGTERM, gate_dir=gate)
    assert f"at step {before_kill} " in termed.log, f"{where}\n{termed.log}"
    assert termed.returncode == 143, f"{where}\n{termed.log}"
    assert termed.committed[-1] == term_at, f"{where}\n{termed.log}"
    uri, step = latest(store, ex)
    assert step == term_at

    # Resumed from the checkpoint named explicitly, as the orchestrator does.
    last = run_example(ex, store, resume=uri)
    assert last.returncode == 0, f"{where}\n{last.log}"
    assert f"resumed from {uri} at step {term_at} " in last.log, f"{where}\n{last.log}"
    assert latest(store, ex)[1] == ex.steps

    assert_bitwise_equal(example_baseline(name)[1], final(store, ex), name)


def test_the_no_block_port_changes_at_most_12_lines_of_the_original_script():
    """`diff` as a user would run it: every added, removed or changed line counts, blank
    lines and whitespace included."""
    out = subprocess.run(["diff", str(NO_BLOCK / "original.py"), str(NO_BLOCK / "train.py")],
                         capture_output=True, text=True, check=False).stdout
    changed = [line for line in out.splitlines() if line.startswith(("<", ">"))]
    original = (NO_BLOCK / "original.py").read_text().count("\n")
    print(f"diff examples/no_block/original.py examples/no_block/train.py: {len(changed)} "
          f"changed lines (original: {original} lines)")
    assert 0 < len(changed) <= 12, out
    assert original >= 120, "the original stands for a typical script of ~150 lines"


def _epoch_lines(log: str) -> list[str]:
    return re.findall(r"^epoch \d+: .*$", log, flags=re.MULTILINE)


def test_sigterm_at_an_epoch_boundary_of_the_no_block_script_exits_143_and_the_resume_runs_that_epochs_evaluation_once(
        example_baseline, tmp_path):
    """Killed mid-epoch, then exactly at the last batch of an epoch: the committed step is an
    epoch boundary whose evaluation and LR decision had not run. Across the three processes
    every epoch's line is printed once, equal to the example_baseline run's, and the run ends
    bitwise identical."""
    ex = EXAMPLES["no_block"]
    store, gate = tmp_path / "store", tmp_path / "gate"
    gate.mkdir()
    mid, boundary = BATCHES_PER_EPOCH + 13, 3 * BATCHES_PER_EPOCH

    first = run_example(ex, store, gate_at=mid, sig=signal.SIGTERM, gate_dir=gate)
    assert first.returncode == 143 and first.committed[-1] == mid, first.log
    assert "stop requested" in first.log, first.log
    second = run_example(ex, store, gate_at=boundary, sig=signal.SIGTERM, gate_dir=gate)
    assert second.returncode == 143 and second.committed[-1] == boundary, second.log
    assert f"resumed from file://{store}" in second.log and f"at step {mid} " in second.log
    third = run_example(ex, store)
    assert third.returncode == 0, third.log
    assert f"at step {boundary} " in third.log, third.log

    base, base_state = example_baseline("no_block")
    runs = [_epoch_lines(r.log) for r in (first, second, third)]
    assert [len(lines) for lines in runs] == [1, 1, 4], runs  # epoch 2's after the resume
    assert runs[2][0].startswith("epoch 2: "), runs
    assert sum(runs, []) == _epoch_lines(base.log)
    assert_bitwise_equal(base_state, final(store, ex), "no_block")
