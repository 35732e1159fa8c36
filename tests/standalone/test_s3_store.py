"""S3Store against a real moto_server over HTTP (see the `s3_env` fixture); what it refuses
before any request, and an endpoint where nothing listens, need no server."""

from __future__ import annotations

import hashlib
import os
import socket
import time

import boto3
import pytest

from trainer.base.errors import (
    AlreadyExistsError,
    ConfigError,
    InvalidNameError,
    StorageError,
)
from trainer.storage.s3 import MIN_PART_SIZE, S3Store

PART = MIN_PART_SIZE  # the smallest part S3 allows: the multipart path with a few MB


@pytest.fixture
def store(s3_env) -> S3Store:
    return S3Store(s3_env["bucket"], "ckpts", part_size=PART, max_workers=3)


def _raw(s3_env):
    return boto3.client("s3")


def _all_keys(s3_env) -> list[str]:
    resp = _raw(s3_env).list_objects_v2(Bucket=s3_env["bucket"])
    return [o["Key"] for o in resp.get("Contents", [])]


@pytest.mark.slow
def test_keys_live_under_the_store_prefix_in_the_bucket_and_list_relative_to_it(store, s3_env):
    # The shared contract (round trips, listing, pointers) is in test_store_contract.py.
    store.put_new("run1/step-2/model.pt", b"weights")
    assert store.uri == s3_env["uri"]
    assert _all_keys(s3_env) == ["ckpts/run1/step-2/model.pt"]
    assert store.list("run1") == ["run1/step-2/model.pt"]


@pytest.mark.slow
@pytest.mark.parametrize("size", [100, 2 * PART + 123], ids=["put_object", "multipart"])
def test_name_taken_while_writing_is_refused_and_the_first_object_kept(store, size):
    with pytest.raises(AlreadyExistsError):
        with store.create("run1/model.pt") as w:
            w.write(os.urandom(size))
            store.put_new("run1/model.pt", b"the other writer won")
    assert store.read_bytes("run1/model.pt") == b"the other writer won"


@pytest.mark.slow
def test_server_refuses_to_complete_a_multipart_upload_over_an_existing_object(s3_env):
    # S3Store relies on If-None-Match on CompleteMultipartUpload for atomic create-once
    # (its HEAD before completing is only a fallback): pin that the server honours it.
    c, bucket = _raw(s3_env), s3_env["bucket"]
    upload = c.create_multipart_upload(Bucket=bucket, Key="k")["UploadId"]
    etag = c.upload_part(Bucket=bucket, Key="k", UploadId=upload, PartNumber=1, Body=b"mine")[
        "ETag"
    ]
    c.put_object(Bucket=bucket, Key="k", Body=b"theirs")
    with pytest.raises(c.exceptions.ClientError) as err:
        c.complete_multipart_upload(
            Bucket=bucket,
            Key="k",
            UploadId=upload,
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]},
            IfNoneMatch="*",
        )
    assert err.value.response["Error"]["Code"] == "PreconditionFailed"
    assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == b"theirs"


class Boom(Exception):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("size", [1000, 2 * PART + 5], ids=["put_object", "multipart"])
def test_failed_write_leaves_nothing_visible(store, s3_env, size):
    with pytest.raises(Boom):
        with store.create("run1/model.pt") as w:
            w.write(os.urandom(size))
            raise Boom()
    assert not store.exists("run1/model.pt")
    assert store.list("run1") == []
    assert _all_keys(s3_env) == []
    uploads = _raw(s3_env).list_multipart_uploads(Bucket=s3_env["bucket"])
    assert uploads.get("Uploads", []) == []  # aborted, no parts left behind
    # The name is still free: a retry of the write succeeds.
    store.put_new("run1/model.pt", b"retry")
    assert store.read_bytes("run1/model.pt") == b"retry"


@pytest.mark.slow
def test_large_object_round_trips_with_matching_sha256(store, s3_env):
    data = os.urandom(3 * PART + 4321)  # three full parts and a short last one
    with store.create("run1/model.pt") as w:
        view = memoryview(data)
        for chunk in (7, 1 << 20, 3 * (1 << 20) + 1, 2 * PART, len(data)):  # odd boundaries
            w.write(view[:chunk])
            view = view[chunk:]
    expected = hashlib.sha256(data).hexdigest()
    assert w.hexdigest() == expected
    assert w.size == len(data)

    head = _raw(s3_env).head_object(Bucket=s3_env["bucket"], Key="ckpts/run1/model.pt")
    assert head["ETag"].strip('"').endswith("-4")  # really went through multipart
    assert store.size("run1/model.pt") == len(data)
    with store.open_read("run1/model.pt") as f:  # parallel ranged GETs into a temp file
        assert hashlib.sha256(f.read()).hexdigest() == expected
        f.seek(len(data) - 10)
        assert f.read() == data[-10:]
    assert hashlib.sha256(store.read_bytes("run1/model.pt")).hexdigest() == expected


@pytest.mark.parametrize("prefix", ["../outside", "a/../..", "a//b", "a\nb"])
def test_a_store_prefix_that_could_escape_is_refused(prefix):
    with pytest.raises(InvalidNameError):
        S3Store("some-bucket", prefix, client=object())


@pytest.mark.parametrize("bucket", ["", "a", "b/c", "user@host", "b:1", "b?x", "-b", "b..c"])
def test_a_bucket_name_that_is_not_one_is_refused_with_the_rule(bucket):
    with pytest.raises(ConfigError, match="3-63 letters"):
        S3Store(bucket, "p", client=object())


@pytest.mark.slow
def test_missing_bucket_is_reported_with_advice(s3_env):
    store = S3Store(f"{s3_env['bucket']}-missing", "ckpts")
    with pytest.raises(StorageError, match="does not exist") as err:
        store.check_reachable()
    assert "-missing" in str(err.value)
    store_ok = S3Store(s3_env["bucket"], "ckpts")
    store_ok.check_reachable()


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_unreachable_endpoint_gives_one_clear_storage_error(aws_env, monkeypatch):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    store = S3Store(
        "some-bucket", "ckpts", max_attempts=2, connect_timeout=0.5, read_timeout=0.5
    )
    started = time.monotonic()
    with pytest.raises(StorageError) as err:
        store.check_reachable()
    msg = str(err.value)
    assert endpoint in msg and "s3://some-bucket/ckpts" in msg and "AWS_ENDPOINT_URL" in msg
    assert err.value.exit_code == 5
    # Every operation reports the same kind of error; none mistakes it for "missing".
    for call in (
        lambda: store.exists("a"),
        lambda: store.read_bytes("a"),
        lambda: store.open_read("a"),
        lambda: store.size("a"),
        lambda: store.list("a"),
        lambda: store.delete("a"),
        lambda: store.read_versioned("a"),
        lambda: store.write_if("a", b"x", None),
        lambda: store.write_overwrite("a", b"x"),
        lambda: store.put_new("a", b"x"),
    ):
        with pytest.raises(StorageError, match="AWS_ENDPOINT_URL"):
            call()
    assert time.monotonic() - started < 10
