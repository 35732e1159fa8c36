"""S3Store against a real moto_server over HTTP (see the `s3_env` fixture)."""

from __future__ import annotations

import hashlib
import os
import socket
import time

import boto3
import pytest

from trainer.errors import (
    AlreadyExistsError,
    InvalidNameError,
    PointerConflictError,
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


def test_small_object_round_trips_and_is_listed_relative_to_the_prefix(store, s3_env):
    written = store.put_new("run1/step-2/model.pt", b"weights")
    store.put_new("run1/step-1/model.pt", b"older")
    store.put_new("run10/other.pt", b"sibling prefix, not under run1/")

    assert written.sha256 == hashlib.sha256(b"weights").hexdigest()
    assert written.size == 7
    assert store.uri == s3_env["uri"]
    assert store.uri_for("run1/step-2/model.pt") == f"{s3_env['uri']}/run1/step-2/model.pt"
    assert store.read_bytes("run1/step-2/model.pt") == b"weights"
    assert store.exists("run1/step-2/model.pt")
    assert store.size("run1/step-2/model.pt") == 7
    with store.open_read("run1/step-2/model.pt") as f:
        f.seek(3)
        assert f.read() == b"ghts"
    assert store.list("run1") == ["run1/step-1/model.pt", "run1/step-2/model.pt"]
    assert "ckpts/run1/step-2/model.pt" in _all_keys(s3_env)

    store.delete("run1/step-2/model.pt")
    assert not store.exists("run1/step-2/model.pt")
    assert store.list("run1") == ["run1/step-1/model.pt"]


def test_missing_objects_read_as_file_not_found(store):
    with pytest.raises(FileNotFoundError):
        store.read_bytes("nope/x")
    with pytest.raises(FileNotFoundError):
        store.open_read("nope/x")
    with pytest.raises(FileNotFoundError):
        store.size("nope/x")
    assert store.exists("nope/x") is False
    assert store.read_versioned("nope/x") == (None, None)
    assert store.list("nope") == []


def test_second_writer_of_the_same_name_is_refused(store, s3_env):
    store.put_new("run1/model.pt", b"first")
    with pytest.raises(AlreadyExistsError, match=f"{s3_env['uri']}/run1/model.pt"):
        store.put_new("run1/model.pt", b"second")
    assert store.read_bytes("run1/model.pt") == b"first"


@pytest.mark.parametrize("size", [100, 2 * PART + 123], ids=["put_object", "multipart"])
def test_name_taken_while_writing_is_refused_and_the_first_object_kept(store, size):
    with pytest.raises(AlreadyExistsError):
        with store.create("run1/model.pt") as w:
            w.write(os.urandom(size))
            store.put_new("run1/model.pt", b"the other writer won")
    assert store.read_bytes("run1/model.pt") == b"the other writer won"


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


def test_pointer_updates_chain_through_version_tokens(store):
    t1 = store.write_if("run1/latest.json", b'{"step": 1}', None)
    data, token = store.read_versioned("run1/latest.json")
    assert (data, token) == (b'{"step": 1}', t1)
    t2 = store.write_if("run1/latest.json", b'{"step": 2}', t1)
    assert t2 != t1
    assert store.read_versioned("run1/latest.json") == (b'{"step": 2}', t2)


def test_stale_pointer_update_is_refused(store):
    t1 = store.write_if("run1/latest.json", b'{"step": 1}', None)
    store.write_if("run1/latest.json", b'{"step": 2}', t1)  # another attempt moves it
    with pytest.raises(PointerConflictError, match="run1/latest.json"):
        store.write_if("run1/latest.json", b'{"step": 3}', t1)
    assert store.read_versioned("run1/latest.json")[0] == b'{"step": 2}'


def test_first_pointer_write_is_refused_if_someone_created_it_first(store):
    store.write_if("run1/latest.json", b'{"step": 5}', None)
    with pytest.raises(PointerConflictError):
        store.write_if("run1/latest.json", b'{"step": 1}', None)
    assert store.read_versioned("run1/latest.json")[0] == b'{"step": 5}'


def test_pointer_deleted_since_it_was_read_is_a_conflict(store):
    t1 = store.write_if("run1/latest.json", b"{}", None)
    store.delete("run1/latest.json")
    with pytest.raises(PointerConflictError):
        store.write_if("run1/latest.json", b"{}", t1)


def test_overwrite_replaces_unconditionally(store):
    store.write_overwrite("run1/heartbeat.json", b"1")
    store.write_overwrite("run1/heartbeat.json", b"2")
    assert store.read_bytes("run1/heartbeat.json") == b"2"


ESCAPING_KEYS = ["../escape", "a/../../b", "/abs", "", "a//b", ".", "a/./b", "a/..", "a\\b", "a/"]


def test_keys_that_try_to_escape_the_prefix_are_refused(store, s3_env):
    for key in ESCAPING_KEYS:
        calls = [
            (store.put_new, key, b"x"),
            (store.read_bytes, key),
            (store.open_read, key),
            (store.exists, key),
            (store.size, key),
            (store.list, key),
            (store.delete, key),
            (store.read_versioned, key),
            (store.write_if, key, b"x", None),
            (store.write_overwrite, key, b"x"),
            (store.uri_for, key),
        ]
        for fn, *args in calls:
            with pytest.raises(InvalidNameError):
                fn(*args)
    with pytest.raises(InvalidNameError):
        S3Store(s3_env["bucket"], "../outside")
    assert _all_keys(s3_env) == []


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


def test_unreachable_endpoint_gives_one_clear_storage_error(s3_env, monkeypatch):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    store = S3Store(
        s3_env["bucket"], "ckpts", max_attempts=2, connect_timeout=0.5, read_timeout=0.5
    )
    started = time.monotonic()
    with pytest.raises(StorageError) as err:
        store.check_reachable()
    msg = str(err.value)
    assert endpoint in msg and s3_env["uri"] in msg and "AWS_ENDPOINT_URL" in msg
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
