"""What every framework's test does to its example: kill it with SIGKILL at a seeded step,
run it again and stop it with SIGTERM at a later seeded step, run it to the end; and count
the lines its port changes."""

from __future__ import annotations

import random
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests.trainer_proc import ROOT


def kill_stop_finish(run: Callable[..., object], seed: str, kill_between: tuple[int, int],
                     steps: int, gate: Path) -> str:
    """`run(n, **gate_kw)` runs the example the n-th time (1, 2, 3) against one store. Returns
    where the signals struck, for the caller's assertion messages."""
    rng = random.Random(seed)
    kill_at = rng.randint(*kill_between)
    term_at = rng.randint(kill_at + 1, steps - 2)
    gate.mkdir()
    where = f"SIGKILL at step {kill_at}, SIGTERM at step {term_at}"
    killed = run(1, gate_at=kill_at, sig=signal.SIGKILL, gate_dir=gate)
    assert killed.returncode == -signal.SIGKILL, f"{where}\n{killed.log}"
    termed = run(2, gate_at=term_at, sig=signal.SIGTERM, gate_dir=gate)
    assert f"at step {killed.committed[-1]} " in termed.log, f"{where}\n{termed.log}"
    assert termed.returncode == 143 and termed.committed[-1] == term_at, f"{where}\n{termed.log}"
    last = run(3)
    assert last.returncode == 0 and f"at step {term_at} " in last.log, f"{where}\n{last.log}"
    return where


def port_changes(example: str) -> int:
    """How many lines `examples/<example>/train.py` changes of its `original.py`."""
    here = ROOT / "examples" / example
    out = subprocess.run(["diff", str(here / "original.py"), str(here / "train.py")],
                         capture_output=True, text=True, check=False).stdout
    changed = [line for line in out.splitlines() if line.startswith(("<", ">"))]
    print(f"diff examples/{example}/original.py train.py: {len(changed)} changed lines")
    return len(changed)
