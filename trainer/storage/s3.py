"""S3 backend (AWS or any S3-compatible server): conditional writes make it create-once.

* Objects are created with ``If-None-Match: *`` (the upload path, one put_object or a
  streamed multipart upload, is `trainer.storage.s3_upload`), so a committed name is
  never replaced.
* The pointer object (latest.json) is updated with ``If-Match: <etag>``: a writer holding
  a stale version gets HTTP 412 and loses the race instead of overwriting.
* Large objects are read by parallel ranged GETs pinned to one ETag.
* Every botocore failure that survives the client's retries is reported as one
  StorageError that names the store and says what to check (`trainer.storage.s3_errors`).

The endpoint, credentials and region come from the standard AWS environment
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile,
AWS_DEFAULT_REGION / AWS_REGION), so the same code talks to AWS, MinIO, Ceph or moto.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import re
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import BinaryIO

from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from ..base.errors import AlreadyExistsError, ConfigError, PointerConflictError, StorageError
from .base import HashingWriter, ObjectStore, validate_key
from .s3_errors import (
    CONFLICT_CODES,
    CONFLICT_RETRIES,
    MISSING_CODES,
    PRECONDITION_CODES,
    code,
    guarded,
    is_one_of,
    status,
    storage_error,
    was_retried,
)
from .s3_upload import DEFAULT_PART_SIZE, MIN_PART_SIZE, MiB, Upload

__all__ = ["DEFAULT_PART_SIZE", "MIN_PART_SIZE", "S3Store", "default_client", "read_uri",
           "validate_bucket"]

SMALL_READ = 8 * MiB  # open_read() below this: one GET into memory


# S3's rule, widened to the legacy names (uppercase, '_') that S3-compatible servers accept:
# nothing that could make a URI or endpoint path mean something else ('/', '@', ':', '?').
_BUCKET_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{1,61}[A-Za-z0-9]")


def validate_bucket(bucket: str) -> str:
    if not isinstance(bucket, str) or not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
        raise ConfigError(
            f"invalid S3 bucket name {bucket!r}: use 3-63 letters, digits, '.', '_' or '-', "
            "starting and ending with a letter or digit (s3://bucket/prefix)"
        )
    return bucket


@functools.cache
def _shared_loader():
    import botocore.loaders

    return botocore.loaders.create_loader()


def default_client(
    *,
    max_attempts: int = 5,
    connect_timeout: float = 10.0,
    read_timeout: float = 120.0,
    max_pool_connections: int = 16,
):
    """A boto3 S3 client from the standard AWS environment, with retries and timeouts."""
    import boto3  # imported here: `import trainer.storage` stays cheap for local stores
    import botocore.session

    core = botocore.session.get_session()
    # A fresh session reads the environment now; only the parsed service models (about
    # 70 ms to load) are shared between sessions.
    core.register_component("data_loader", _shared_loader())
    session = boto3.session.Session(botocore_session=core)
    config = Config(
        retries={"mode": "standard", "max_attempts": max_attempts},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_pool_connections=max_pool_connections,
    )
    # AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) is read by botocore itself; custom
    # endpoints get path-style addressing, which every S3-compatible server accepts.
    return session.client("s3", region_name=session.region_name or "us-east-1", config=config)


def read_uri(uri: str, client=None) -> bytes:
    """The bytes of one object named by an s3://bucket/key URI (a dataset file, a config):
    FileNotFoundError if it does not exist, StorageError if S3 could not be asked."""
    from urllib.parse import urlparse

    parsed = urlparse(uri)
    try:
        body = (client or default_client()).get_object(Bucket=parsed.netloc,
                                                       Key=parsed.path.lstrip("/"))
        return body["Body"].read()
    except ClientError as e:
        if code(e) in ("NoSuchKey", "NoSuchBucket", "404"):
            raise FileNotFoundError(uri) from e
        raise StorageError(f"{uri} could not be read: {e}; check the endpoint and the "
                           "credentials (AWS_*)") from e
    except BotoCoreError as e:
        raise StorageError(f"{uri} could not be read: {e}; check the endpoint and the "
                           "credentials (AWS_*)") from e


class S3Store(ObjectStore):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        client=None,
        *,
        part_size: int = DEFAULT_PART_SIZE,
        max_workers: int = 4,
        max_attempts: int = 5,
        connect_timeout: float = 10.0,
        read_timeout: float = 120.0,
    ):
        validate_bucket(bucket)
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} bytes (S3's minimum)")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            validate_key(self.prefix)
        self.part_size = part_size
        self.max_workers = max(1, max_workers)
        self._client = client or default_client(
            max_attempts=max_attempts,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=max(16, 2 * self.max_workers + 2),
        )
        self.endpoint = self._client.meta.endpoint_url
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"

    # ----------------------------------------------------------------- helpers

    def _full(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def uri_for(self, key: str) -> str:
        return f"{self.uri}/{validate_key(key)}"

    def _storage_error(self, action: str, target: str, e: Exception) -> StorageError:
        return storage_error(self.bucket, self.endpoint, action, target, e)

    def _guard(self, action: str, target: str):
        """Turn botocore failures (already retried by the client) into StorageError."""
        return guarded(self.bucket, self.endpoint, action, target)

    # ------------------------------------------------------------ reachability

    def check_reachable(self) -> None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if is_one_of(e, MISSING_CODES) or code(e) == "NoSuchBucket":
                raise StorageError(
                    f"S3 store {self.uri} is not usable: bucket {self.bucket!r} does not "
                    f"exist at endpoint {self.endpoint}. Create the bucket, or check "
                    "AWS_ENDPOINT_URL and the store URI."
                ) from e
            raise self._storage_error("use S3 store", self.uri, e) from e
        except BotoCoreError as e:
            raise self._storage_error("use S3 store", self.uri, e) from e

    # ---------------------------------------------------------------- creation

    @contextmanager
    def create(self, key: str) -> Iterator[HashingWriter]:
        full = self._full(key)
        uri = self.uri_for(key)
        # Fail before the caller spends minutes producing a payload for a taken name; the
        # conditional write at the end is what actually guarantees create-once.
        if self.exists(key):
            raise AlreadyExistsError(f"{uri} already exists; refusing to overwrite")
        upload = Upload(self, full, uri)
        writer = HashingWriter(upload.write)
        try:
            yield writer
            upload.finish()
        except BaseException:
            upload.abort()
            raise

    # ----------------------------------------------------------------- reading

    def _head(self, key: str) -> dict:
        full, uri = self._full(key), self.uri_for(key)
        with self._guard("read", uri):
            try:
                return self._client.head_object(Bucket=self.bucket, Key=full)
            except ClientError as e:
                if is_one_of(e, MISSING_CODES):
                    raise FileNotFoundError(f"{uri} does not exist") from None
                raise

    def read_bytes(self, key: str) -> bytes:
        full, uri = self._full(key), self.uri_for(key)
        with self._guard("read", uri):
            try:
                resp = self._client.get_object(Bucket=self.bucket, Key=full)
            except ClientError as e:
                if is_one_of(e, MISSING_CODES):
                    raise FileNotFoundError(f"{uri} does not exist") from None
                raise
            return resp["Body"].read()

    def open_read(self, key: str) -> BinaryIO:
        head = self._head(key)
        size = int(head["ContentLength"])
        if size <= SMALL_READ:
            return io.BytesIO(self.read_bytes(key))
        return self._download_ranges(key, size, head["ETag"])

    def _download_ranges(self, key: str, size: int, etag: str) -> BinaryIO:
        """Parallel ranged GETs written at their offsets into an unnamed temp file."""
        full, uri = self._full(key), self.uri_for(key)
        f = tempfile.TemporaryFile()
        fd = f.fileno()

        def fetch(start: int) -> None:
            end = min(start + self.part_size, size) - 1
            with self._guard("read", uri):
                try:
                    # If-Match: a range of a different object version must not be spliced in.
                    resp = self._client.get_object(
                        Bucket=self.bucket, Key=full, Range=f"bytes={start}-{end}", IfMatch=etag
                    )
                except ClientError as e:
                    if is_one_of(e, PRECONDITION_CODES | MISSING_CODES):
                        raise StorageError(f"{uri} changed or vanished while being read") from e
                    raise
                body = resp["Body"]
                pos = start
                while chunk := body.read(8 * MiB):
                    try:
                        os.pwrite(fd, chunk, pos)
                    except OSError as e:
                        raise StorageError(
                            f"cannot read {uri}: its local temp copy failed ({e.strerror}; "
                            f"under {tempfile.gettempdir()}). Free space there or set TMPDIR "
                            "to a larger disk, then resume."
                        ) from e
                    pos += len(chunk)
            if pos != end + 1:
                raise StorageError(f"short read of {uri}: range ending at {end} stopped at {pos}")

        try:
            with ThreadPoolExecutor(self.max_workers, thread_name_prefix="s3-get") as pool:
                futures = [pool.submit(fetch, s) for s in range(0, size, self.part_size)]
                done, pending = wait(futures, return_when=FIRST_EXCEPTION)
                for fut in pending:
                    fut.cancel()
                for fut in futures:
                    if fut.done() and not fut.cancelled() and fut.exception() is not None:
                        raise fut.exception()
            f.seek(0)
            return f  # type: ignore[return-value]
        except BaseException:
            f.close()
            raise

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
        except FileNotFoundError:
            return False
        return True

    def size(self, key: str) -> int:
        return int(self._head(key)["ContentLength"])

    def list(self, prefix: str) -> list[str]:
        base = self._full(prefix) + "/"
        strip = len(self.prefix) + 1 if self.prefix else 0
        out: list[str] = []
        with self._guard("list", self.uri_for(prefix)):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base
            )
            for page in pages:
                out.extend(obj["Key"][strip:] for obj in page.get("Contents", ()))
        return sorted(out)

    def children(self, prefix: str) -> list[str]:
        base = self._full(prefix) + "/"
        out: set[str] = set()
        with self._guard("list", self.uri_for(prefix)):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base, Delimiter="/"
            )
            for page in pages:
                out.update(p["Prefix"][len(base):].rstrip("/")
                           for p in page.get("CommonPrefixes", ()))
                out.update(obj["Key"][len(base):] for obj in page.get("Contents", ()))
        return sorted(out)

    def delete(self, key: str) -> None:
        with self._guard("delete", self.uri_for(key)):
            self._client.delete_object(Bucket=self.bucket, Key=self._full(key))

    # --------------------------------------------------------------- pointers

    def read_versioned(self, key: str) -> tuple[bytes | None, str | None]:
        full, uri = self._full(key), self.uri_for(key)
        with self._guard("read", uri):
            try:
                resp = self._client.get_object(Bucket=self.bucket, Key=full)
            except ClientError as e:
                if is_one_of(e, MISSING_CODES):
                    return None, None
                raise
            return resp["Body"].read(), resp["ETag"]

    def write_if(self, key: str, data: bytes, expected_token: str | None) -> str:
        full, uri = self._full(key), self.uri_for(key)
        cond = {"IfNoneMatch": "*"} if expected_token is None else {"IfMatch": expected_token}
        for attempt in range(CONFLICT_RETRIES):
            with self._guard("write", uri):
                try:
                    resp = self._client.put_object(Bucket=self.bucket, Key=full, Body=data, **cond)
                    return resp["ETag"]
                except ClientError as e:
                    # 404 with If-Match: the pointer was deleted since it was read.
                    lost = is_one_of(e, PRECONDITION_CODES) or (
                        expected_token is not None and is_one_of(e, MISSING_CODES)
                    )
                    conflict = is_one_of(e, CONFLICT_CODES)
                    if not (lost or conflict):
                        raise
                    if conflict and attempt + 1 < CONFLICT_RETRIES:
                        time.sleep(0.05 * (attempt + 1))
                        continue
                    own = hashlib.md5(data, usedforsecurity=False).hexdigest()
                    if self._retried_own_write(e, full, own):
                        return f'"{own}"'
                    raise PointerConflictError(
                        f"{uri} was changed by another writer (expected "
                        f"{'no object' if expected_token is None else expected_token}; "
                        f"the server answered {code(e) or status(e)})"
                    ) from e
        raise AssertionError("unreachable")

    def _retried_own_write(self, e: ClientError, full_key: str, own_etag: str) -> bool:
        """Was this precondition failure caused by our own earlier attempt?

        If a conditional write succeeds but its response is lost (timeout, reset), the
        client's automatic retry finds the condition broken by that very write. Only then
        (the response says it was retried) do we look: the object is ours if its ETag is
        the one our bytes produce (MD5, or MD5-of-part-MD5s for multipart).
        """
        if not was_retried(e):
            return False
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=full_key)
        except (ClientError, BotoCoreError):
            return False
        return head.get("ETag", "").strip('"') == own_etag

    def write_overwrite(self, key: str, data: bytes) -> None:
        with self._guard("write", self.uri_for(key)):
            self._client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data)
