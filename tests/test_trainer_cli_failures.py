"""Bad input, corruption and hostile checkpoints through the real CLI, with exit codes."""

from __future__ import annotations

import hashlib
import json
import pickle
import signal
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.polling import wait_for
from tests.trainer_proc import ROOT, run_trainer, write_config
from trainer.layout import HEARTBEAT

pytestmark = pytest.mark.slow


def tree_digest(root: Path) -> dict[str, str]:
    """What a run has committed: every file but the heartbeat (liveness, not state)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".") and p.name != HEARTBEAT}


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


def test_explicit_resume_of_a_corrupt_checkpoint_exits_3_naming_file_and_mismatch(
        trained, tmp_path):
    store, cfg = _copy(trained, tmp_path)
    p = _ckdir(store) / "step-000000060-a1" / "state.pt"
    data = bytearray(p.read_bytes())
    data[-100] ^= 0x10
    p.write_bytes(bytes(data))
    before = tree_digest(store)
    uri = (_ckdir(store) / "step-000000060-a1").as_uri()
    res = cli("--config", str(cfg), "--store", str(store), "--resume", uri)
    assert res.returncode == 3, res.stderr
    assert "step-000000060-a1/state.pt" in res.stderr and "SHA-256" in res.stderr
    assert tree_digest(store) == before


def test_explicit_resume_of_a_missing_checkpoint_exits_2_naming_the_uri(trained, tmp_path):
    store, cfg = _copy(trained, tmp_path)
    before = tree_digest(store)
    uri = (_ckdir(store) / "step-000000999-a1").as_uri()
    res = cli("--config", str(cfg), "--store", str(store), "--resume", uri)
    assert res.returncode == 2
    assert "step-000000999-a1" in res.stderr and "does not exist" in res.stderr
    res = cli("--config", str(cfg), "--store", str(store), "--resume", "s3://nope")
    assert res.returncode == 2 and "does not name a checkpoint" in res.stderr
    assert tree_digest(store) == before


class _Boom:
    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_a_checkpoint_carrying_a_code_running_pickle_is_refused_without_running_it(
        trained, tmp_path):
    store, cfg = _copy(trained, tmp_path)
    marker = tmp_path / "pwned"
    name = "step-000000060-a1"
    ck = _ckdir(store) / name
    # Build a real torch zip file whose data.pkl would call Path.touch(marker) on load,
    # with a manifest whose hashes match it: an attacker who can write the store.
    boom = _Boom()
    boom.marker = str(marker)
    with zipfile.ZipFile(ck / "evil.pt", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"model": boom}, protocol=2))
        z.writestr("archive/version", "3\n")
        z.writestr("archive/byteorder", "little")
    payload = (ck / "evil.pt").read_bytes()
    (ck / "evil.pt").unlink()
    (ck / "state.pt").unlink()
    (ck / "state.pt").write_bytes(payload)
    manifest = json.loads((ck / "MANIFEST.json").read_text())
    manifest["files"]["state.pt"] = {"size": len(payload),
                                     "sha256": hashlib.sha256(payload).hexdigest()}
    (ck / "MANIFEST.json").write_text(json.dumps(manifest))
    res = cli("--config", str(cfg), "--store", str(store), "--resume", ck.as_uri())
    assert res.returncode == 3, res.stderr
    assert "safe loader refuses" in res.stderr
    assert not marker.exists()


@pytest.mark.parametrize("cfg,needle", [
    ({"max_step": 10}, "unknown config key(s): max_step"),
    ({"checkpoint": {"evry_steps": 5}}, "unknown config key(s) in 'checkpoint': evry_steps"),
    ({"batch_size": "32"}, "'batch_size': expected an integer"),
    ({"optim": {"lr": "fast"}}, "'optim.lr': expected a number"),
    ({"run": "../escape"}, "invalid run name '../escape'"),
    ({"run": "a/b"}, "invalid run name 'a/b'"),
    ({"task": "nope.module:build"}, "cannot import module 'nope.module'"),
])
def test_bad_config_exits_2_with_one_clear_message_and_touches_nothing(
        trained, tmp_path, cfg, needle):
    store, _ = _copy(trained, tmp_path)
    before = tree_digest(store)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"run": "equiv", **cfg}))
    res = cli("--config", str(bad), "--store", str(store))
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr
    assert "Traceback" not in res.stderr
    assert tree_digest(store) == before


def test_missing_config_file_and_unknown_flag_exit_2(tmp_path):
    res = cli("--config", str(tmp_path / "nope.json"), "--store", str(tmp_path / "s"))
    assert res.returncode == 2 and "does not exist" in res.stderr
    res = cli("--config", "x.json", "--resum", "auto")
    assert res.returncode == 2 and "unrecognized arguments" in res.stderr


def test_unreachable_s3_store_exits_5_naming_the_endpoint(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = write_config(tmp_path / "cfg.json")
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_MAX_ATTEMPTS": "1", "AWS_RETRY_MODE": "standard"}
    res = cli("--config", str(cfg), "--store", "s3://bucket/p", env=env)
    assert res.returncode == 5, res.stderr
    assert f"127.0.0.1:{port}" in res.stderr and "Traceback" not in res.stderr


def test_unwritable_local_store_exits_2(tmp_path):
    cfg = write_config(tmp_path / "cfg.json")
    res = cli("--config", str(cfg), "--store", "/proc/self/nope")
    assert res.returncode == 2 and "cannot use local store" in res.stderr


def test_a_zombie_attempt_cannot_advance_a_run_after_a_newer_attempt_claimed_it(tmp_path):
    import os

    store = tmp_path / "store"
    slow = write_config(tmp_path / "slow.json", max_steps=400,
                        task_args={"n_train": 1024, "hidden": 48, "step_delay": 0.03},
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
    out, _ = zombie.communicate(timeout=120)
    assert res.returncode == 0, res.log
    assert zombie.returncode == 6, out
    assert "another attempt took over" in out
    final = json.loads(ptr.read_text())
    assert final["attempt"] == 2 and final["step"] == 400
    assert final["checkpoint"] == "step-000000400-a2"


def test_sigterm_during_training_commits_the_current_step_and_exits_143(tmp_path):
    cfg = write_config(tmp_path / "cfg.json",
                       task_args={"n_train": 1024, "hidden": 48, "step_delay": 0.02})
    res = run_trainer(cfg, str(tmp_path / "store"), interrupt_at=9, sig=signal.SIGTERM)
    assert res.returncode == 143
    assert res.committed[-1] >= 9
