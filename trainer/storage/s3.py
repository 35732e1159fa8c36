"""S3 backend (AWS or any S3-compatible server): conditional writes make it create-once.

* Objects are created with ``If-None-Match: *`` (``put_object`` for small payloads,
  ``complete_multipart_upload`` for large ones), so a committed name is never replaced.
* The pointer object (latest.json) is updated with ``If-Match: <etag>``: a writer holding
  a stale version gets HTTP 412 and loses the race instead of overwriting.
* Large payloads are streamed: the caller writes into a part-sized buffer, full parts are
  uploaded by a small thread pool while the caller keeps writing, and at most
  ``max_workers + 1`` parts are held in memory at once.
* Every botocore failure that survives the client's retries (connection refused,
  timeouts, 5xx, bad credentials, missing bucket) is reported as one StorageError that
  names the store and says what to check.

The endpoint, credentials and region come from the standard AWS environment
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile,
AWS_DEFAULT_REGION / AWS_REGION), so the same code talks to AWS, MinIO, Ceph or moto.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import BinaryIO

from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)

from trainer.errors import AlreadyExistsError, ConfigError, PointerConflictError, StorageError
from trainer.storage.base import HashingWriter, ObjectStore, validate_key

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_PART_SIZE = 64 * MiB
MIN_PART_SIZE = 5 * MiB  # S3's lower bound for every part but the last
MAX_PARTS = 10_000  # S3's upper bound on parts per upload
SMALL_READ = 8 * MiB  # open_read() below this: one GET into memory

_MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
_PRECONDITION_CODES = {"412", "PreconditionFailed"}
_CONFLICT_CODES = {"409", "ConditionalRequestConflict"}
_AUTH_CODES = {
    "403",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
}
_CONNECTION_ERRORS = (
    EndpointConnectionError,
    ConnectTimeoutError,
    ReadTimeoutError,
    ConnectionClosedError,
)
# A 409 on a conditional write means another conditional write to the same key was in
# flight; AWS asks the client to retry, and the retry then gets a definite 200 or 412.
_CONFLICT_RETRIES = 3


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


def _code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _is(e: ClientError, codes: set[str]) -> bool:
    return _code(e) in codes or str(_status(e)) in codes


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
        where = f"{target} (endpoint {self.endpoint})"
        if isinstance(e, ClientError):
            code = _code(e) or str(_status(e))
            if code == "NoSuchBucket":
                return StorageError(
                    f"cannot {action} {where}: bucket {self.bucket!r} does not exist. "
                    "Create it, or fix the store URI / AWS_ENDPOINT_URL."
                )
            if _is(e, _AUTH_CODES):
                return StorageError(
                    f"cannot {action} {where}: access denied ({code}). Check the AWS "
                    "credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE) "
                    f"and that they may use bucket {self.bucket!r}."
                )
            msg = e.response.get("Error", {}).get("Message", "")
            return StorageError(
                f"cannot {action} {where}: the server answered {code}"
                + (f" ({msg})" if msg else "")
                + " after retries."
            )
        if isinstance(e, NoCredentialsError | PartialCredentialsError):
            return StorageError(
                f"cannot {action} {where}: no usable AWS credentials. Set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)."
            )
        if isinstance(e, _CONNECTION_ERRORS):
            return StorageError(
                f"cannot {action} {where}: the S3 endpoint could not be reached ({e}). "
                "Check AWS_ENDPOINT_URL, the network, and that the server is running."
            )
        return StorageError(f"cannot {action} {where}: {type(e).__name__}: {e}")

    @contextmanager
    def _guard(self, action: str, target: str):
        """Turn botocore failures (already retried by the client) into StorageError."""
        try:
            yield
        except (ClientError, BotoCoreError) as e:
            raise self._storage_error(action, target, e) from e

    def _checksum_kwargs(self) -> dict:
        # With botocore's default ("when_supported") every upload_part carries a CRC32;
        # S3 then wants the algorithm declared on create and the part checksums on
        # complete. With AWS_REQUEST_CHECKSUM_CALCULATION=when_required (for servers that
        # do not know flexible checksums) none of this is sent.
        mode = getattr(self._client.meta.config, "request_checksum_calculation", None)
        return {"ChecksumAlgorithm": "CRC32"} if mode == "when_supported" else {}

    # ------------------------------------------------------------ reachability

    def check_reachable(self) -> None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except ClientError as e:
            if _is(e, _MISSING_CODES) or _code(e) == "NoSuchBucket":
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
        upload = _Upload(self, full, uri)
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
                if _is(e, _MISSING_CODES):
                    raise FileNotFoundError(f"{uri} does not exist") from None
                raise

    def read_bytes(self, key: str) -> bytes:
        full, uri = self._full(key), self.uri_for(key)
        with self._guard("read", uri):
            try:
                resp = self._client.get_object(Bucket=self.bucket, Key=full)
            except ClientError as e:
                if _is(e, _MISSING_CODES):
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
                    if _is(e, _PRECONDITION_CODES | _MISSING_CODES):
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
                if _is(e, _MISSING_CODES):
                    return None, None
                raise
            return resp["Body"].read(), resp["ETag"]

    def write_if(self, key: str, data: bytes, expected_token: str | None) -> str:
        full, uri = self._full(key), self.uri_for(key)
        cond = {"IfNoneMatch": "*"} if expected_token is None else {"IfMatch": expected_token}
        for attempt in range(_CONFLICT_RETRIES):
            with self._guard("write", uri):
                try:
                    resp = self._client.put_object(Bucket=self.bucket, Key=full, Body=data, **cond)
                    return resp["ETag"]
                except ClientError as e:
                    # 404 with If-Match: the pointer was deleted since it was read.
                    lost = _is(e, _PRECONDITION_CODES) or (
                        expected_token is not None and _is(e, _MISSING_CODES)
                    )
                    conflict = _is(e, _CONFLICT_CODES)
                    if not (lost or conflict):
                        raise
                    if conflict and attempt + 1 < _CONFLICT_RETRIES:
                        time.sleep(0.05 * (attempt + 1))
                        continue
                    own = hashlib.md5(data, usedforsecurity=False).hexdigest()
                    if self._retried_own_write(e, full, own):
                        return f'"{own}"'
                    raise PointerConflictError(
                        f"{uri} was changed by another writer (expected "
                        f"{'no object' if expected_token is None else expected_token}; "
                        f"the server answered {_code(e) or _status(e)})"
                    ) from e
        raise AssertionError("unreachable")

    def _retried_own_write(self, e: ClientError, full_key: str, own_etag: str) -> bool:
        """Was this precondition failure caused by our own earlier attempt?

        If a conditional write succeeds but its response is lost (timeout, reset), the
        client's automatic retry finds the condition broken by that very write. Only then
        (the response says it was retried) do we look: the object is ours if its ETag is
        the one our bytes produce (MD5, or MD5-of-part-MD5s for multipart).
        """
        if not e.response.get("ResponseMetadata", {}).get("RetryAttempts"):
            return False
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=full_key)
        except (ClientError, BotoCoreError):
            return False
        return head.get("ETag", "").strip('"') == own_etag

    def write_overwrite(self, key: str, data: bytes) -> None:
        with self._guard("write", self.uri_for(key)):
            self._client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data)


class _Upload:
    """The sink behind S3Store.create: one put_object, or a multipart upload.

    Bytes are copied once into a part-sized buffer. While everything fits in one part no
    request is made; the first full part starts a multipart upload and is handed to the
    thread pool, and a semaphore blocks the writer while `max_workers` parts are in
    flight, so memory stays at most (max_workers + 1) * part_size.
    """

    def __init__(self, store: S3Store, full_key: str, uri: str):
        self.store = store
        self.client = store._client
        self.key = full_key
        self.uri = uri
        self.part_size = store.part_size
        # Grown on demand (large reallocs are cheap mremaps), so a small put costs no 64 MiB.
        self.buf = bytearray()
        self.upload_id: str | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.slots = threading.BoundedSemaphore(store.max_workers)
        self.futures: list[Future] = []
        self.checksum = store._checksum_kwargs()

    def _already_exists(self) -> AlreadyExistsError:
        return AlreadyExistsError(f"{self.uri} already exists; refusing to overwrite")

    # -- writer side

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = min(view.nbytes, self.part_size - len(self.buf))
            self.buf += view[:n]
            view = view[n:]
            if len(self.buf) == self.part_size:
                self._dispatch_part()

    def _raise_failed_part(self) -> None:
        for fut in self.futures:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()

    def _dispatch_part(self) -> None:
        if self.upload_id is None:
            with self.store._guard("start upload of", self.uri):
                resp = self.client.create_multipart_upload(
                    Bucket=self.store.bucket, Key=self.key, **self.checksum
                )
            self.upload_id = resp["UploadId"]
            self.pool = ThreadPoolExecutor(self.store.max_workers, thread_name_prefix="s3-put")
        self._raise_failed_part()
        self.slots.acquire()
        try:
            self._raise_failed_part()  # a part may have failed while we waited
        except BaseException:
            self.slots.release()
            raise
        number = len(self.futures) + 1
        if number > MAX_PARTS:
            self.slots.release()
            raise StorageError(f"{self.uri}: more than {MAX_PARTS} parts; use a larger part_size")
        assert self.pool is not None
        fut = self.pool.submit(self._upload_part, number, self.buf)
        fut.add_done_callback(lambda _f: self.slots.release())
        self.futures.append(fut)
        self.buf = bytearray()

    def _upload_part(self, number: int, body) -> dict:
        with self.store._guard("upload part of", self.uri):
            resp = self.client.upload_part(
                Bucket=self.store.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                PartNumber=number,
                Body=body,
                **self.checksum,
            )
        part = {"PartNumber": number, "ETag": resp["ETag"]}
        if resp.get("ChecksumCRC32"):
            part["ChecksumCRC32"] = resp["ChecksumCRC32"]
        return part

    # -- end of block

    def finish(self) -> None:
        if self.upload_id is None:
            self._put_small()
            return
        try:
            self._complete()
        finally:
            self.pool.shutdown(wait=True)

    def _complete(self) -> None:
        if self.buf:
            self._dispatch_part()
        wait(self.futures, return_when=FIRST_EXCEPTION)
        self._raise_failed_part()
        parts = [f.result() for f in self.futures]
        # AWS S3 and moto 5.2.5 honour If-None-Match on CompleteMultipartUpload, so the
        # completion itself is an atomic create-once. Some S3-compatible servers ignore
        # the header; for them this HEAD is the only guard, and a writer that completes
        # the same name between it and our complete (one round trip) would be replaced.
        if self.store.exists(self.store_key):
            raise self._already_exists()
        digest = hashlib.md5(usedforsecurity=False)
        for p in parts:
            digest.update(bytes.fromhex(p["ETag"].strip('"')))
        own_etag = f"{digest.hexdigest()}-{len(parts)}"
        self._conditional_create(
            "complete upload of",
            lambda: self.client.complete_multipart_upload(
                Bucket=self.store.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
                IfNoneMatch="*",
            ),
            own_etag,
        )

    def _put_small(self) -> None:
        body = bytes(self.buf)
        self.buf = bytearray()
        self._conditional_create(
            "write",
            lambda: self.client.put_object(
                Bucket=self.store.bucket, Key=self.key, Body=body, IfNoneMatch="*"
            ),
            hashlib.md5(body, usedforsecurity=False).hexdigest(),
        )

    def _conditional_create(self, action: str, call, own_etag: str) -> None:
        for attempt in range(_CONFLICT_RETRIES):
            with self.store._guard(action, self.uri):
                try:
                    call()
                    return
                except ClientError as e:
                    if _is(e, _CONFLICT_CODES) and attempt + 1 < _CONFLICT_RETRIES:
                        time.sleep(0.05 * (attempt + 1))
                        continue
                    if not _is(e, _PRECONDITION_CODES | _CONFLICT_CODES):
                        raise
                    if self.store._retried_own_write(e, self.key, own_etag):
                        return
                    raise self._already_exists() from e

    @property
    def store_key(self) -> str:
        prefix = self.store.prefix
        return self.key[len(prefix) + 1 :] if prefix else self.key

    def abort(self) -> None:
        """Nothing may become visible: stop the parts and abort the multipart upload."""
        self.buf = bytearray()
        if self.pool is not None:
            for fut in self.futures:
                fut.cancel()
            self.pool.shutdown(wait=True)
        if self.upload_id is not None:
            try:
                self.client.abort_multipart_upload(
                    Bucket=self.store.bucket, Key=self.key, UploadId=self.upload_id
                )
            except (ClientError, BotoCoreError) as e:
                # The upload stays invisible either way; only its parts linger until a
                # bucket lifecycle rule (AbortIncompleteMultipartUpload) removes them.
                log.warning("could not abort multipart upload of %s: %s", self.uri, e)
