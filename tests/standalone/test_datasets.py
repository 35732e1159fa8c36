"""Datasets by reference: content manifests of a local directory and an S3 prefix, and the
refusal to resume a run on data that changed."""

from __future__ import annotations

import pytest
import torch

from trainer.api.session import CheckpointSession
from trainer.base.errors import ConfigError
from trainer.base.outcomes import Outcome
from trainer.checkpoints.dataset import check_same_data, dataset_manifest


def _thousand_files(root) -> None:
    for i in range(1000):
        sub = root / f"shard-{i // 100:02d}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"sample-{i:04d}.bin").write_bytes(i.to_bytes(4, "little") * 16)


def test_a_directory_of_1000_files_is_versioned_by_content_and_one_byte_changes_it(tmp_path):
    root = tmp_path / "data"
    _thousand_files(root)
    m = dataset_manifest(str(root))
    assert len(m.files) == 1000 and m.total_bytes == 64_000
    assert m.files["shard-03/sample-0345.bin"]["size"] == 64
    assert dataset_manifest(f"file://{root}").version == m.version  # same data, same version
    victim = root / "shard-07" / "sample-0777.bin"
    data = bytearray(victim.read_bytes())
    data[10] ^= 1
    victim.write_bytes(bytes(data))
    changed = dataset_manifest(str(root))
    assert changed.version != m.version
    diff = [k for k in m.files if m.files[k] != changed.files[k]]
    assert diff == ["shard-07/sample-0777.bin"]


@pytest.mark.slow
def test_an_s3_prefix_is_versioned_by_size_and_etag_and_one_byte_changes_it(s3_env):
    import boto3

    s3 = boto3.client("s3")
    bucket = s3_env["bucket"]
    for i in range(30):
        s3.put_object(Bucket=bucket, Key=f"data/part-{i:03d}.bin", Body=bytes([i]) * 100)
    s3.put_object(Bucket=bucket, Key="other/not-mine.bin", Body=b"x")
    m = dataset_manifest(f"s3://{bucket}/data/")
    assert len(m.files) == 30 and m.total_bytes == 3000
    assert all("etag" in f for f in m.files.values())
    s3.put_object(Bucket=bucket, Key="data/part-007.bin", Body=bytes([7]) * 99 + b"\x08")
    assert dataset_manifest(f"s3://{bucket}/data/").version != m.version


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: (p / "empty").mkdir() or p / "empty", "empty directory"),
])
def test_a_missing_or_empty_dataset_is_bad_input_naming_it(tmp_path, make, message):
    with pytest.raises(ConfigError, match=message):
        dataset_manifest(str(make(tmp_path)))


def test_an_unreadable_dataset_file_is_bad_input_naming_the_file(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "ok.bin").write_bytes(b"x")
    (root / "broken.bin").symlink_to(tmp_path / "gone")  # a link to nothing cannot be read
    with pytest.raises(ConfigError, match="broken.bin"):
        dataset_manifest(str(root))


@pytest.mark.slow
def test_an_empty_or_missing_s3_prefix_is_bad_input(s3_env):
    with pytest.raises(ConfigError, match="holds no objects"):
        dataset_manifest(f"s3://{s3_env['bucket']}/nothing-here/")
    with pytest.raises(ConfigError, match="cannot be listed"):
        dataset_manifest("s3://no-such-bucket-ckpt-assets/data/")


def test_a_different_version_is_refused_and_the_message_says_what_to_do():
    check_same_data("a" * 64, "a" * 64, "uri")
    check_same_data(None, "b" * 64, "uri")  # checkpoints from before versioning: no claim
    with pytest.raises(ConfigError, match="register a new training run"):
        check_same_data("a" * 64, "b" * 64, "file:///s/e/r/checkpoints/step-000000010-a1")


def test_a_session_refuses_to_resume_on_a_changed_dataset_and_keeps_its_checkpoints(tmp_path):
    root = tmp_path / "data"
    _thousand_files(root)
    store = str(tmp_path / "store")

    def session(**kw):
        return CheckpointSession(run="r", store=store, dataset=str(root), install_signals=False,
                                 heartbeat_seconds=60, every_steps=1, **kw)

    with session() as ckpt:
        ckpt.restore(model=torch.nn.Linear(2, 2))
        ckpt.step(1)
        ckpt.step(2)
    committed = ckpt.repo.committed()
    (root / "shard-00" / "sample-0000.bin").write_bytes(b"changed")
    again = session(continue_finished=True)  # past the end: a finished run trains nothing
    with pytest.raises(SystemExit) as exc, again:
        again.restore(model=torch.nn.Linear(2, 2))
    assert exc.value.code == Outcome.BAD_INPUT.exit_code
    assert again.repo.committed() == committed
