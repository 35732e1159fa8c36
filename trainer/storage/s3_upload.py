"""The upload path of the S3 store: one conditional put_object, or a multipart upload.

* An object is created with ``If-None-Match: *`` (``put_object`` for a payload of at most
  one part, ``complete_multipart_upload`` for larger ones), so a committed name is never
  replaced.
* Large payloads are streamed: the caller writes into a part-sized buffer, full parts are
  uploaded by a small thread pool while the caller keeps writing, and at most
  ``max_workers + 1`` parts are held in memory at once.
* A failed or interrupted write aborts the multipart upload: nothing becomes visible.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from botocore.exceptions import BotoCoreError, ClientError

from ..base.errors import AlreadyExistsError, StorageError
from .s3_errors import (
    CONFLICT_CODES,
    CONFLICT_RETRIES,
    PRECONDITION_CODES,
    is_one_of,
)

if TYPE_CHECKING:
    from .s3 import S3Store

log = logging.getLogger("trainer.storage.s3")  # the S3 store's logger: its warnings read as the store's

MiB = 1 << 20
DEFAULT_PART_SIZE = 64 * MiB
MIN_PART_SIZE = 5 * MiB  # S3's lower bound for every part but the last
MAX_PARTS = 10_000  # S3's upper bound on parts per upload


def checksum_kwargs(client) -> dict:
    # With botocore's default ("when_supported") every upload_part carries a CRC32;
    # S3 then wants the algorithm declared on create and the part checksums on
    # complete. With AWS_REQUEST_CHECKSUM_CALCULATION=when_required (for servers that
    # do not know flexible checksums) none of this is sent.
    mode = getattr(client.meta.config, "request_checksum_calculation", None)
    return {"ChecksumAlgorithm": "CRC32"} if mode == "when_supported" else {}


class Upload:
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
        self.checksum = checksum_kwargs(store._client)

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
        for attempt in range(CONFLICT_RETRIES):
            with self.store._guard(action, self.uri):
                try:
                    call()
                    return
                except ClientError as e:
                    if is_one_of(e, CONFLICT_CODES) and attempt + 1 < CONFLICT_RETRIES:
                        time.sleep(0.05 * (attempt + 1))
                        continue
                    if not is_one_of(e, PRECONDITION_CODES | CONFLICT_CODES):
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
