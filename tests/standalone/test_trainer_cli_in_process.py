"""The trainer CLI in process: `trainer.cli.main([...])` returns the exit code the process
would exit with, and says why in one line.

Each decision here (which input is refused, with which code and message, touching nothing;
how a task is evaluated) is the trainer's own; tests/standalone/test_trainer_cli_failures.py shows the
same through the real `python -m trainer` process (its exit status, its stderr).
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import signal
import socket
import zipfile
from pathlib import Path

import pytest
import torch

from trainer.api.session import CheckpointSession
from trainer.base.outcomes import Outcome
from trainer.checkpoints.layout import HEARTBEAT
from trainer.cli import main
from trainer.process.contract import Env

RUN = "equiv"
BAD_INPUT = Outcome.BAD_INPUT.exit_code
UNLOADABLE = Outcome.CHECKPOINT_UNLOADABLE.exit_code


@pytest.fixture(autouse=True)
def as_a_fresh_process(monkeypatch):
    """What a training process changes in its own interpreter (signal handlers, torch's
    threads and determinism), put back after each test; none of the orchestrator's
    variables inherited from the test process."""
    for var in Env:
        monkeypatch.delenv(var.value, raising=False)
    monkeypatch.delenv("CHECKPOINT_PATH", raising=False)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def _tree_digest(root: Path) -> dict[str, str]:
    """What a run has committed: every file but the heartbeat (liveness, not state)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".") and p.name != HEARTBEAT}


def _config(path: Path, **overrides) -> Path:
    path.write_text(json.dumps({"run": RUN, "max_steps": 60, "eval_every": 0, **overrides}))
    return path


@pytest.fixture
def store(tmp_path) -> Path:
    """A run with checkpoints at steps 20, 40 and 60, committed through the session API."""
    root = tmp_path / "store"
    model = torch.nn.Linear(4, 2)
    with CheckpointSession(run=RUN, store=str(root), install_signals=False, max_steps=60,
                           every_steps=20, keep_last=5, heartbeat_seconds=60) as ckpt:
        ckpt.restore(model=model)
        for step in range(1, 61):
            ckpt.step(step, loss=1.0 / step)
    return root


def _checkpoint(store: Path, step: int) -> Path:
    return store / "default" / RUN / "checkpoints" / f"step-{step:09d}-a1"


def _said(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("cfg,needle", [
    ({"max_step": 10}, "unknown config key(s): max_step"),
    ({"checkpoint": {"evry_steps": 5}}, "unknown config key(s) in 'checkpoint': evry_steps"),
    ({"batch_size": "32"}, "'batch_size': expected an integer"),
    ({"optim": {"lr": "fast"}}, "'optim.lr': expected a number"),
    ({"run": "../escape"}, "invalid run name '../escape'"),
    ({"run": "a/b"}, "invalid run name 'a/b'"),
    ({"task": "nope.module:build"}, "cannot import module 'nope.module'"),
    ({"task": "tests.user_tasks:wrong_optimizer", "task_args": {"n": 64}},
     "optimizer is a str"),
])
def test_bad_config_exits_2_with_one_clear_message_and_touches_nothing(
        store, tmp_path, caplog, cfg, needle):
    before = _tree_digest(store)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"run": RUN, **cfg}))
    with caplog.at_level(logging.INFO, "trainer"):
        assert main(["--config", str(bad), "--store", str(store)]) == BAD_INPUT
    assert needle in _said(caplog)
    assert "Traceback" not in caplog.text
    assert _tree_digest(store) == before


def test_a_missing_config_file_exits_2_naming_it(tmp_path, caplog):
    with caplog.at_level(logging.INFO, "trainer"):
        assert main(["--config", str(tmp_path / "nope.json"),
                     "--store", str(tmp_path / "s")]) == BAD_INPUT
    assert "does not exist" in _said(caplog)
    assert not (tmp_path / "s").exists()


def test_an_unknown_flag_exits_2_with_the_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--config", "x.json", "--resum", "auto"])
    assert exit_.value.code == BAD_INPUT
    err = capsys.readouterr().err
    assert "unrecognized arguments: --resum" in err and "usage:" in err


def test_an_unwritable_local_store_exits_2(tmp_path, caplog):
    with caplog.at_level(logging.INFO, "trainer"):
        assert main(["--config", str(_config(tmp_path / "cfg.json")),
                     "--store", "/proc/self/nope"]) == BAD_INPUT
    assert "cannot use local store" in _said(caplog)


def test_an_explicit_resume_of_a_missing_checkpoint_exits_2_naming_the_uri(
        store, tmp_path, caplog):
    before = _tree_digest(store)
    cfg = _config(tmp_path / "cfg.json")
    uri = _checkpoint(store, 999).as_uri()
    with caplog.at_level(logging.INFO, "trainer"):
        assert main(["--config", str(cfg), "--store", str(store), "--resume", uri]) == BAD_INPUT
    assert "step-000000999-a1" in _said(caplog) and "does not exist" in _said(caplog)
    caplog.clear()
    with caplog.at_level(logging.INFO, "trainer"):
        assert main(["--config", str(cfg), "--store", str(store),
                     "--resume", "s3://nope"]) == BAD_INPUT
    assert "does not name a checkpoint" in _said(caplog)
    assert _tree_digest(store) == before


def test_an_explicit_resume_of_a_corrupt_checkpoint_exits_3_naming_file_and_mismatch(
        store, tmp_path, caplog):
    state = _checkpoint(store, 60) / "state.pt"
    data = bytearray(state.read_bytes())
    data[-100] ^= 0x10
    state.write_bytes(bytes(data))
    before = _tree_digest(store)
    uri = _checkpoint(store, 60).as_uri()
    with caplog.at_level(logging.INFO, "trainer"):
        assert main(["--config", str(_config(tmp_path / "cfg.json")), "--store", str(store),
                     "--resume", uri]) == UNLOADABLE
    assert "step-000000060-a1/state.pt" in _said(caplog) and "SHA-256" in _said(caplog)
    assert _tree_digest(store) == before


class _Boom:
    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _plant_code_running_pickle(checkpoint: Path, marker: Path) -> None:
    """A real torch zip file whose data.pkl would call Path.touch(marker) on load, with a
    manifest whose hashes match it: what an attacker who can write the store could leave."""
    boom = _Boom()
    boom.marker = str(marker)
    evil = checkpoint / "evil.pt"
    with zipfile.ZipFile(evil, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"model": boom}, protocol=2))
        z.writestr("archive/version", "3\n")
        z.writestr("archive/byteorder", "little")
    payload = evil.read_bytes()
    evil.unlink()
    (checkpoint / "state.pt").unlink()
    (checkpoint / "state.pt").write_bytes(payload)
    manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
    manifest["files"]["state.pt"] = {"size": len(payload),
                                     "sha256": hashlib.sha256(payload).hexdigest()}
    (checkpoint / "MANIFEST.json").write_text(json.dumps(manifest))


def test_a_checkpoint_carrying_a_code_running_pickle_exits_3_without_running_it(
        store, tmp_path, caplog):
    marker = tmp_path / "pwned"
    _plant_code_running_pickle(_checkpoint(store, 60), marker)
    # Step 60 is the run's final checkpoint: only a run continued past its end loads it.
    cfg = _config(tmp_path / "cfg.json", checkpoint={"continue_finished": True})
    with caplog.at_level(logging.INFO, "trainer"):
        assert main(["--config", str(cfg), "--store", str(store),
                     "--resume", _checkpoint(store, 60).as_uri()]) == UNLOADABLE
    assert "safe loader refuses" in _said(caplog)
    assert not marker.exists()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_an_unreachable_s3_store_exits_5_naming_the_endpoint(tmp_path, caplog, aws_env,
                                                             monkeypatch):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_RETRY_MODE", "standard")
    with caplog.at_level(logging.INFO, "trainer"):
        code = main(["--config", str(_config(tmp_path / "cfg.json")),
                     "--store", "s3://bucket/p"])
    assert code == Outcome.STORAGE_UNAVAILABLE.exit_code
    assert endpoint.removeprefix("http://") in _said(caplog)
    assert "Traceback" not in caplog.text


def test_a_tasks_evaluation_runs_in_eval_mode_without_gradients(tmp_path):
    # The task asserts both inside its eval_fn: a violation is a bug (exit 1).
    cfg = _config(tmp_path / "cfg.json", task="tests.user_tasks:strict_eval", max_steps=4,
                  eval_every=2, task_args={"n_train": 64, "n_eval": 32, "hidden": 8})
    assert main(["--config", str(cfg), "--store", str(tmp_path / "store")]) == 0
    assert (_checkpoint(tmp_path / "store", 4) / "MANIFEST.json").exists()
