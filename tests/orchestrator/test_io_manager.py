"""CheckpointIOManager: create-once versions with a SHA-256 manifest written last, verified
before anything is deserialized; partition keys cannot escape the store."""


import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import dagster as dg
import pytest
import torch

from ckpt_assets.base.registration import register_training_run
from ckpt_assets.defs.io_managers import CheckpointIOManager
from ckpt_assets.defs.partitions import training_runs
from ckpt_assets.defs.resources import CheckpointStore
from ckpt_assets.records.asset_versions import StoredObjectError, VersionedRepo
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import ROOT, training_config
from trainer.base.errors import InvalidNameError
from trainer.storage import open_store


class BlobConfig(dg.Config):
    kind: str = "json"
    n: int = 1


@dg.asset(partitions_def=training_runs, io_manager_key="checkpoint_io_manager")
def blob(config: BlobConfig):
    if config.kind == "json":
        return {"n": config.n, "items": list(range(config.n)), "name": "x"}
    return {"weights": torch.arange(config.n, dtype=torch.float32), "n": config.n}


@dg.asset(partitions_def=training_runs, io_manager_key="checkpoint_io_manager")
def consumer(blob) -> int:
    return int(blob["n"])


def _resources(store: str) -> dict:
    s = CheckpointStore(uri=store)
    return {"checkpoint_io_manager": CheckpointIOManager(store=s)}


def _run(instance, store: str, key: str, assets, kind: str = "json", n: int = 1):
    if not instance.has_dynamic_partition("training_runs", key):
        instance.add_dynamic_partitions("training_runs", [key])
    cfg = {"ops": {"blob": {"config": {"kind": kind, "n": n}}}} if blob in assets else None
    # `consumer` alone loads `blob` from the store (it is not recomputed).
    selection = assets if blob in assets else None
    return dg.materialize([blob, consumer] if selection is None else assets, instance=instance,
                          partition_key=key, resources=_resources(store), run_config=cfg,
                          selection=selection or [consumer], raise_on_error=False)


@pytest.fixture
def registered(tmp_path) -> tuple[str, Path]:
    store = str(tmp_path / "store")
    register_training_run(open_store(store), "r1", training_config(), "exp")
    return store, tmp_path / "store" / "exp" / "r1" / "assets" / "blob"


def _error_text(result) -> str:
    return "\n".join(ev.event_specific_data.error.to_string() for ev in result.all_events
                     if ev.event_type_value == "STEP_FAILURE")


def test_each_output_is_a_new_create_once_version_and_older_versions_stay_byte_identical(
        instance, registered):
    store, base = registered
    assert _run(instance, store, "r1", [blob], n=3).success
    v1 = (base / "v-000001" / "value.json").read_bytes()
    assert _run(instance, store, "r1", [blob], kind="torch", n=5).success
    assert (base / "v-000001" / "value.json").read_bytes() == v1
    assert sorted(p.name for p in base.iterdir() if not p.name.startswith(".")) == [
        "latest.json", "v-000001", "v-000002"]
    m2 = json.loads((base / "v-000002" / "MANIFEST.json").read_text())
    assert m2["meta"]["format"] == "torch" and set(m2["files"]) == {"value.pt"}
    assert m2["parent"] == "v-000001"
    res = _run(instance, store, "r1", [consumer])
    assert res.success and res.output_for_node("consumer") == 5


def test_a_json_value_and_a_tensor_value_round_trip_through_load_input(instance, registered):
    store, _ = registered
    assert _run(instance, store, "r1", [blob], kind="torch", n=4).success
    repo = VersionedRepo(open_store(store), "exp", "r1", "assets/blob")
    value, m = repo.load_current()
    assert torch.equal(value["weights"], torch.arange(4, dtype=torch.float32))
    assert _run(instance, store, "r1", [blob], kind="json", n=2).success
    value, m = repo.load_current()
    assert value == {"n": 2, "items": [0, 1], "name": "x"} and m.name == "v-000002"


def test_a_payload_without_its_manifest_is_invisible_and_the_previous_version_loads(
        instance, registered):
    store, base = registered
    assert _run(instance, store, "r1", [blob], n=7).success
    # A writer cut off between payload and manifest: the payload is there, nothing else.
    open_store(store).put_new("exp/r1/assets/blob/v-000002/value.json", b'{"n": 999}')
    repo = VersionedRepo(open_store(store), "exp", "r1", "assets/blob")
    assert repo.committed() == ["v-000001"]
    res = _run(instance, store, "r1", [consumer])
    assert res.success and res.output_for_node("consumer") == 7
    # The next output takes a fresh name and never touches the orphan.
    assert _run(instance, store, "r1", [blob], n=8).success
    assert (base / "v-000002" / "value.json").read_bytes() == b'{"n": 999}'
    assert repo.current() == "v-000003"


@pytest.mark.slow
def test_a_writer_sigkilled_between_payload_and_manifest_leaves_nothing_visible(
        instance, registered, tmp_path):
    store, base = registered
    assert _run(instance, store, "r1", [blob], n=3).success
    # A real process, really killed: it materializes `blob` and SIGKILLs itself at the
    # moment the payload is durable and the manifest is about to be written.
    script = tmp_path / "killed_writer.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        import dagster as dg
        from ckpt_assets.records.asset_versions import VersionedRepo
        from tests.orchestrator.test_io_manager import blob, _resources

        def die(self, pending, meta):
            os.kill(os.getpid(), signal.SIGKILL)

        VersionedRepo.commit = die
        with dg.DagsterInstance.ephemeral() as inst:
            inst.add_dynamic_partitions("training_runs", ["r1"])
            dg.materialize([blob], instance=inst, partition_key="r1", resources=_resources({store!r}),
                           run_config={{"ops": {{"blob": {{"config": {{"n": 42}}}}}}}})
    """))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert (base / "v-000002" / "value.json").exists()  # the payload made it to disk ...
    assert not (base / "v-000002" / "MANIFEST.json").exists()  # ... the manifest did not
    repo = VersionedRepo(open_store(store), "exp", "r1", "assets/blob")
    assert repo.committed() == ["v-000001"] and repo.current() == "v-000001"
    res = _run(instance, store, "r1", [consumer])
    assert res.success and res.output_for_node("consumer") == 3


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "manifest garbage",
                                    "payload deleted"])
def test_a_corrupt_stored_object_is_refused_with_an_error_naming_the_file(
        instance, registered, damage):
    store, base = registered
    assert _run(instance, store, "r1", [blob], kind="torch", n=1000).success
    payload, manifest = base / "v-000001" / "value.pt", base / "v-000001" / "MANIFEST.json"
    if damage == "flip a byte":
        data = bytearray(payload.read_bytes())
        data[len(data) // 2] ^= 0xFF
        payload.write_bytes(bytes(data))
        says = ["value.pt", "SHA-256", "corrupt"]
    elif damage == "truncate":
        payload.write_bytes(payload.read_bytes()[:100])
        says = ["value.pt", "100 bytes", "truncated"]
    elif damage == "manifest garbage":
        manifest.write_text("{not json")
        says = ["MANIFEST.json", "corrupt"]
    else:
        payload.unlink()
        says = ["value.pt", "missing"]
    repo = VersionedRepo(open_store(store), "exp", "r1", "assets/blob")
    with pytest.raises(StoredObjectError) as e:
        repo.load_current()
    for s in says:
        assert s in str(e.value)
    assert "Nothing was deserialized" in str(e.value)
    res = _run(instance, store, "r1", [consumer])
    assert not res.success
    assert "refusing to load version v-000001" in _error_text(res)


@pytest.mark.parametrize("key", ["../escape", "a/b", ".hidden", "UPPER", "x" * 65])
def test_partition_keys_that_could_escape_the_store_are_refused(tmp_path, key):
    store = tmp_path / "store"
    io = CheckpointIOManager(store=CheckpointStore(uri=str(store)))
    ctx = dg.build_output_context(asset_key=dg.AssetKey("blob"), partition_key=key)
    with pytest.raises(InvalidNameError, match="lowercase letters, digits"):
        io.handle_output(ctx, {"n": 1})
    ictx = dg.build_input_context(asset_key=dg.AssetKey("blob"), partition_key=key)
    with pytest.raises(InvalidNameError, match="lowercase letters, digits"):
        io.load_input(ictx)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_a_materialization_for_an_escaping_partition_key_writes_nothing(instance, tmp_path):
    store = str(tmp_path / "store")
    res = _run(instance, store, "../../outside", [blob])
    assert not res.success
    assert "invalid training run name (partition key) '../../outside'" in _error_text(res)
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_an_output_for_an_unregistered_run_is_refused_with_what_to_do(instance, tmp_path):
    res = _run(instance, str(tmp_path / "store"), "nobody", [blob])
    assert not res.success
    assert "is not registered" in _error_text(res) and "register" in _error_text(res)


def test_load_input_of_model_checkpoint_returns_the_newest_checkpoint_that_verifies(tmp_path):
    """The trainer's walk-back, through the IO manager: a corrupt newest checkpoint is skipped."""
    from ckpt_assets.defs.io_managers import CHECKPOINT_KEY, load_checkpoint_state
    from trainer.api.session import CheckpointSession

    store = tmp_path / "store"
    model = torch.nn.Linear(4, 2)
    # Checkpoints at steps 10, 20 and 30, committed the way a training loop commits them.
    with CheckpointSession(run="wb", store=str(store), install_signals=False, max_steps=30,
                           every_steps=10, keep_last=3, heartbeat_seconds=60) as ckpt:
        ckpt.restore(model=model)
        for step in range(1, 31):
            ckpt.step(step, loss=1.0 / step)
    latest = store / "default" / "wb" / "checkpoints" / "step-000000030-a1" / "state.pt"
    data = bytearray(latest.read_bytes())
    data[-50] ^= 0xFF
    latest.write_bytes(bytes(data))
    state = load_checkpoint_state(open_store(str(store)), "default", "wb")
    info = state[CHECKPOINT_KEY]
    assert info.record.step == 20 and info.record.name == "step-000000020-a1"
    assert [s.checkpoint for s in info.skipped] == ["step-000000030-a1"]
    assert int(state["loop"]["step"]) == 20
    assert os.path.exists(latest)  # nothing is deleted by reading


class _NoImport:
    """A meta-path finder that refuses to import one module."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, name, path, target=None):
        if name == self.name:
            raise ImportError(f"{name} was imported")
        return None


def test_a_plain_record_is_stored_as_json_without_importing_torch(monkeypatch):
    """A run worker that stores only records (the dataset's) never imports torch for it:
    that was 1.5 s of CPU before a resume's trainer started."""
    from ckpt_assets.defs.io_managers import serialize

    assert serialize({"t": torch.zeros(1)})[0] == "torch"
    monkeypatch.delitem(sys.modules, "torch")  # as in a process that never imported it
    monkeypatch.setattr(sys, "meta_path", [_NoImport("torch"), *sys.meta_path])
    fmt, payload = serialize({"kind": "uri", "files": [{"path": "a", "bytes": 3}]})
    assert fmt == "json" and json.loads(payload)["kind"] == "uri"
