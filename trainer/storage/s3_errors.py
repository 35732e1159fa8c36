"""How S3 answers read: which error codes mean missing, a lost condition, a conflict, or
denied access, and the one StorageError every other failure becomes.

Every botocore failure that survives the client's retries (connection refused, timeouts,
5xx, bad credentials, missing bucket) is reported as one StorageError that names the store
and says what to check.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

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

from ..base.errors import StorageError

MISSING_CODES = {"404", "NoSuchKey", "NotFound"}
PRECONDITION_CODES = {"412", "PreconditionFailed"}
CONFLICT_CODES = {"409", "ConditionalRequestConflict"}
AUTH_CODES = {
    "403",
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
}
CONNECTION_ERRORS = (
    EndpointConnectionError,
    ConnectTimeoutError,
    ReadTimeoutError,
    ConnectionClosedError,
)
# A 409 on a conditional write means another conditional write to the same key was in
# flight; AWS asks the client to retry, and the retry then gets a definite 200 or 412.
CONFLICT_RETRIES = 3


def code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def is_one_of(e: ClientError, codes: set[str]) -> bool:
    return code(e) in codes or str(status(e)) in codes


def was_retried(e: ClientError) -> bool:
    """Did the client send this request more than once before this answer?"""
    return bool(e.response.get("ResponseMetadata", {}).get("RetryAttempts"))


def storage_error(bucket: str, endpoint: str, action: str, target: str,
                  e: Exception) -> StorageError:
    """One StorageError for a failure that survived retries, saying what to check."""
    where = f"{target} (endpoint {endpoint})"
    if isinstance(e, ClientError):
        answered = code(e) or str(status(e))
        if answered == "NoSuchBucket":
            return StorageError(
                f"cannot {action} {where}: bucket {bucket!r} does not exist. "
                "Create it, or fix the store URI / AWS_ENDPOINT_URL."
            )
        if is_one_of(e, AUTH_CODES):
            return StorageError(
                f"cannot {action} {where}: access denied ({answered}). Check the AWS "
                "credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE) "
                f"and that they may use bucket {bucket!r}."
            )
        msg = e.response.get("Error", {}).get("Message", "")
        return StorageError(
            f"cannot {action} {where}: the server answered {answered}"
            + (f" ({msg})" if msg else "")
            + " after retries."
        )
    if isinstance(e, NoCredentialsError | PartialCredentialsError):
        return StorageError(
            f"cannot {action} {where}: no usable AWS credentials. Set "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)."
        )
    if isinstance(e, CONNECTION_ERRORS):
        return StorageError(
            f"cannot {action} {where}: the S3 endpoint could not be reached ({e}). "
            "Check AWS_ENDPOINT_URL, the network, and that the server is running."
        )
    return StorageError(f"cannot {action} {where}: {type(e).__name__}: {e}")


@contextmanager
def guarded(bucket: str, endpoint: str, action: str, target: str) -> Iterator[None]:
    """Turn botocore failures (already retried by the client) into StorageError."""
    try:
        yield
    except (ClientError, BotoCoreError) as e:
        raise storage_error(bucket, endpoint, action, target, e) from e
