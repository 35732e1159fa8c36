"""Corruption fallbacks, a zombie attempt and SIGTERM through the real trainer CLI process.

The CLI's bad-input, unloadable-checkpoint and unreachable-store exits are decided in
process by `trainer.cli.main` (tests/standalone/test_trainer_cli_in_process.py); one real process here
still shows exit 2 reaching the shell (missing config, unknown flag)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.polling import wait_for
from tests.trainer_proc import ROOT, run_trainer, write_config

pytestmark = pytest.mark.slow


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "trainer", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                          timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run with three committed checkpoints (steps 20, 40, 60)."""
    d = tmp_path_factory.mktemp("trained")
    cfg = write_config(d / "cfg.json", max_steps=60, eval_every=0,
                       checkpoint={"every_steps": 20, "keep_last": 5, "on_epoch_end": False})
    res = run_trainer(cfg, str(d / "store"))
    assert res.returncode == 0, res.log
    return d, cfg


def _copy(trained, tmp_path) -> tuple[Path, Path]:
    import shutil

    d, cfg = trained
    shutil.copytree(d / "store", tmp_path / "store")
    return tmp_path / "store", cfg


def _ckdir(store: Path) -> Path:
    return store / "default" / "equiv" / "checkpoints"


def test_bit_flip_in_newest_payload_resumes_from_previous_valid_checkpoint_and_says_so(
        trained, tmp_path):
    store, cfg = _copy(trained, tmp_path)
    p = _ckdir(store) / "step-000000060-a1" / "state.pt"
    data = bytearray(p.read_bytes())
    data[len(data) // 3] ^= 0x04
    p.write_bytes(bytes(data))
    longer = write_config(tmp_path / "more.json", max_steps=70, eval_every=0,
                          checkpoint={"every_steps": 20, "keep_last": 5, "on_epoch_end": False})
    res = run_trainer(longer, str(store))
    assert res.returncode == 0, res.log
    assert "CHECKPOINT FALLBACK" in res.log and "step-000000060-a1" in res.log
    assert "resumed from" in res.log and "at step 40" in res.log


def test_truncated_payload_and_corrupt_manifest_both_fall_back(trained, tmp_path):
    store, cfg = _copy(trained, tmp_path)
    p = _ckdir(store) / "step-000000060-a1" / "state.pt"
    p.write_bytes(p.read_bytes()[:1000])
    m = _ckdir(store) / "step-000000040-a1" / "MANIFEST.json"
    m.write_text(m.read_text()[:-40])
    longer = write_config(tmp_path / "more.json", max_steps=70, eval_every=0,
                          checkpoint={"every_steps": 20, "keep_last": 5, "on_epoch_end": False})
    res = run_trainer(longer, str(store))
    assert res.returncode == 0, res.log
    assert "truncated" in res.log and "unreadable" in res.log
    assert "at step 20" in res.log


class _Boom:
    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_missing_config_file_and_unknown_flag_exit_2(tmp_path):
    res = cli("--config", str(tmp_path / "nope.json"), "--store", str(tmp_path / "s"))
    assert res.returncode == 2 and "does not exist" in res.stderr
    res = cli("--config", "x.json", "--resum", "auto")
    assert res.returncode == 2 and "unrecognized arguments" in res.stderr


def test_a_zombie_attempt_cannot_advance_a_run_after_a_newer_attempt_claimed_it(tmp_path):
    import os

    store = tmp_path / "store"
    # Slow enough (120 s in all) that it is still training when the newer attempt claims.
    slow = write_config(tmp_path / "slow.json", max_steps=400,
                        task_args={"n_train": 1024, "hidden": 48, "step_delay": 0.3},
                        checkpoint={"every_steps": 5})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    zombie = subprocess.Popen([sys.executable, "-m", "trainer", "--config", str(slow), "--store",
                               str(store)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env, cwd=ROOT)
    ptr = _ckdir(store) / "latest.json"
    wait_for(lambda: ptr.exists() and (json.loads(ptr.read_text()).get("step") or 0) >= 10,
             120, 0.2, "the first attempt to commit step 10")
    fast = write_config(tmp_path / "fast.json", max_steps=400,
                        task_args={"n_train": 1024, "hidden": 48},
                        checkpoint={"every_steps": 5})
    res = run_trainer(fast, str(store))
    out, _ = zombie.communicate(timeout=300)
    assert res.returncode == 0, res.log
    assert zombie.returncode == 6, out
    # Whichever sees the newer claim first stops it: its next commit (the pointer moved) or
    # its heartbeat (the run fenced), which its next step then obeys. Neither writes.
    assert "another attempt took over" in out or "was superseded" in out, out
    final = json.loads(ptr.read_text())
    assert final["attempt"] == 2 and final["step"] == 400
    assert final["checkpoint"] == "step-000000400-a2"


def test_the_toy_tasks_hold_records_a_stop_without_taking_a_lock():
    # The handler runs between two bytecodes of the main thread, which may hold the lock it
    # would take (an Event's, inside the hold's own wait): the trainer then waited for itself
    # forever and ignored every later SIGTERM until it was killed.
    from trainer.tasks.toy import Hold

    locks = []

    def watch(frame, event, arg):
        if event == "c_call" and type(getattr(arg, "__self__", None)).__name__ in (
                "lock", "RLock"):
            locks.append(arg)

    hold = Hold(after=9)
    sys.setprofile(watch)
    try:
        hold._record(signal.SIGTERM, None)
    finally:
        sys.setprofile(None)
    assert hold.signum == signal.SIGTERM and locks == []


def test_sigterm_commits_the_step_it_interrupts_and_the_resume_runs_on_without_pausing(tmp_path):
    # `pause_after_step`: the fresh attempt waits after step 9, so the signal lands at a
    # known step, with no clock to race; the resumed attempt never pauses.
    cfg = write_config(tmp_path / "cfg.json",
                       task_args={"n_train": 1024, "hidden": 48, "pause_after_step": 9})
    res = run_trainer(cfg, str(tmp_path / "store"), interrupt_at=9, sig=signal.SIGTERM)
    assert res.returncode == 143, res.log
    assert res.committed == [10], res.log
    res = run_trainer(cfg, str(tmp_path / "store"), timeout=120)
    assert res.returncode == 0, res.log
    assert "resumed" in res.log and res.committed[-1] == 110, res.log
