"""A dataset is regular files: anything that could block a reader (a FIFO, a device, a link
out of the dataset) is refused naming the entry, at once, by the trainer, by an own-loop
session and by the `training_dataset` asset, and nothing committed is lost."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ckpt_assets.base.datasets import describe_dataset
from ckpt_assets.base.registration import Registration
from tests.trainer_proc import ROOT, run_trainer, write_config
from trainer.base.errors import ConfigError
from trainer.checkpoints.dataset import dataset_manifest
from trainer.checkpoints.repo import CheckpointRepo
from trainer.config import config_from_dict
from trainer.storage import open_store

# A reader that blocks on a FIFO blocks for ever: a generous deadline tells a hang from a
# slow machine.
HANG_S = 60


def _finishes(fn):
    """`fn()`'s outcome ('value' or 'error'), failing the test if it is still running after
    HANG_S (it is left behind on a daemon thread: a blocked open() cannot be interrupted)."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive(), f"still blocked after {HANG_S}s: versioning read a non-file"
    return out


def _data_dir(root: Path) -> Path:
    (root / "shard").mkdir(parents=True)
    (root / "a.bin").write_bytes(b"a" * 100)
    (root / "shard" / "b.bin").write_bytes(b"b" * 50)
    return root


def _fifo(d: Path) -> str:
    os.mkfifo(d / "shard" / "pipe")
    return "shard/pipe"


def _dev_zero(d: Path) -> str:
    (d / "zeros").symlink_to("/dev/zero")
    return "zeros"


def _socket(d: Path) -> str:
    # AF_UNIX paths are short (108 bytes): bind from inside the directory.
    cwd = os.getcwd()
    os.chdir(d)
    try:
        s = socket.socket(socket.AF_UNIX)
        s.bind("sock")
    finally:
        os.chdir(cwd)
    s.close()  # the socket's file stays
    return "sock"


HAZARDS = {"fifo": (_fifo, "FIFO"), "dev-zero-link": (_dev_zero, "/dev/zero"),
           "socket": (_socket, "socket")}


@pytest.mark.parametrize("hazard", HAZARDS)
def test_a_fifo_device_link_or_socket_in_a_dataset_is_refused_naming_it_without_blocking(
        tmp_path, hazard):
    make, word = HAZARDS[hazard]
    d = _data_dir(tmp_path / "data")
    entry = make(d)
    out = _finishes(lambda: dataset_manifest(str(d)))
    assert isinstance(out.get("error"), ConfigError), out
    assert repr(entry) in str(out["error"]) and word in str(out["error"])


@pytest.mark.parametrize("target", ["/dev/zero", "fifo"])
def test_a_dataset_that_is_itself_a_device_or_fifo_is_refused(tmp_path, target):
    if target == "fifo":
        os.mkfifo(tmp_path / "fifo")
    path = tmp_path / "data"
    path.symlink_to(tmp_path / target if target == "fifo" else target)
    out = _finishes(lambda: dataset_manifest(str(path)))
    assert isinstance(out.get("error"), ConfigError), out
    assert "a dataset is a regular file or a directory" in str(out["error"])


def test_links_inside_the_dataset_are_followed_for_files_and_not_walked_for_directories(
        tmp_path):
    d = _data_dir(tmp_path / "data")
    plain = dataset_manifest(str(d))
    (d / "alias.bin").symlink_to("shard/b.bin")
    (d / "shard-again").symlink_to("shard")
    m = dataset_manifest(str(d))
    assert set(m.files) == {"a.bin", "shard/b.bin", "alias.bin"}
    assert m.files["alias.bin"] == plain.files["shard/b.bin"]
    # The dataset's own path may be a link (/data/current -> v3): same files, same version.
    (tmp_path / "current").symlink_to(d)
    assert dataset_manifest(str(tmp_path / "current")).files == m.files


def test_a_link_out_of_the_dataset_is_refused_even_to_a_regular_file(tmp_path):
    d = _data_dir(tmp_path / "data")
    (tmp_path / "elsewhere.bin").write_bytes(b"x")
    (d / "shard" / "out.bin").symlink_to(tmp_path / "elsewhere.bin")
    with pytest.raises(ConfigError, match="'shard/out.bin' is a symlink to .*outside the dataset"):
        dataset_manifest(str(d))


def test_the_function_the_asset_calls_refuses_a_fifo_without_blocking(tmp_path):
    d = _data_dir(tmp_path / "data")
    _fifo(d)
    config = config_from_dict({"run": "r", "dataset": str(d), "task": "trainer.tasks.toy:build"})
    reg = Registration("r", "default", config, "file:///nowhere/config.json", "0" * 64)
    out = _finishes(lambda: describe_dataset(reg))
    assert isinstance(out.get("error"), ConfigError), out
    assert "'shard/pipe' is a FIFO" in str(out["error"])


# -- real processes ------------------------------------------------------------------------

SESSION_SCRIPT = """
import sys
import torch
from trainer import CheckpointSession

with CheckpointSession(run="r", experiment="e", store=sys.argv[1], dataset=sys.argv[2],
                       every_steps=1, heartbeat_seconds=60, continue_finished=True) as ckpt:
    start = ckpt.restore(model=torch.nn.Linear(2, 2))
    print("resumed after step", start)
    for step in range(start + 1, start + 3):
        ckpt.step(step, loss=1.0)
"""


def _session_script(tmp_path: Path, store: Path, data: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "own_loop.py"
    script.write_text(SESSION_SCRIPT)
    try:
        return subprocess.run([sys.executable, str(script), str(store), str(data)],
                              capture_output=True, text=True, timeout=HANG_S, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"the own-loop script was still running after {HANG_S}s: it blocked")


@pytest.mark.slow
@pytest.mark.parametrize("hazard", ["fifo", "dev-zero-link"])
def test_the_trainer_exits_2_at_once_on_a_dataset_holding_a_fifo_or_a_dev_zero_link(
        tmp_path, hazard):
    make, word = HAZARDS[hazard]
    d = _data_dir(tmp_path / "data")
    entry = make(d)
    cfg = write_config(tmp_path / "cfg.json", dataset=str(d), max_steps=5,
                       task="tests.user_tasks:directory_dataset")
    res = run_trainer(cfg, str(tmp_path / "store"), timeout=HANG_S)
    assert res.returncode == 2, res.log  # -9 here: it blocked and the deadline killed it
    assert f"bad_input: dataset {d}: entry {entry!r}" in res.log and word in res.log
    assert "Traceback" not in res.log


@pytest.mark.slow
def test_an_own_loop_session_exits_2_on_a_fifo_added_later_and_keeps_what_it_committed(
        tmp_path):
    d = _data_dir(tmp_path / "data")
    store = tmp_path / "store"
    first = _session_script(tmp_path, store, d)
    assert first.returncode == 0, first.stderr
    repo = CheckpointRepo(open_store(str(store)), "e", "r")
    committed = repo.committed()
    assert len(committed) == 3  # steps 1 and 2, and step 2 again as the end
    _fifo(d)
    res = _session_script(tmp_path, store, d)
    assert res.returncode == 2, res.stderr
    assert "'shard/pipe' is a FIFO" in res.stderr
    assert repo.committed() == committed and repo.read_pointer().step == 2
    for name in committed:
        repo.verify(name)
    os.unlink(d / "shard" / "pipe")
    again = _session_script(tmp_path, store, d)
    assert again.returncode == 0 and "resumed after step 2" in again.stdout, again.stderr
    assert repo.read_pointer().step == 4


@pytest.mark.slow
def test_the_training_dataset_asset_fails_as_bad_input_on_a_fifo(tmp_path, monkeypatch):
    import dagster as dg

    from ckpt_assets.definitions import make_resources
    from tests.dagster_fixtures import materialize_run, step_failure_metadata, training_config

    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    d = _data_dir(tmp_path / "data")
    _fifo(d)
    with dg.DagsterInstance.ephemeral() as instance:
        res = _finishes(lambda: materialize_run(
            instance, "fifo-run", make_resources(str(tmp_path / "store"),
                                                 tracking_uri=f"file://{tmp_path}/mlruns"),
            training=training_config(dataset=str(d)), with_checks=False))["value"]
    assert not res.success
    desc, md = step_failure_metadata(res, "training_dataset")
    assert md["exit_code"] == 2 and md["failure_class"] == "bad_input"
    assert "'shard/pipe' is a FIFO" in desc
