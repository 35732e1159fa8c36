"""Stores: `file:///abs/path`, a plain path, or `s3://bucket/prefix`."""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from ..base.errors import ConfigError
from .base import (
    NAME_RULE,
    HashingWriter,
    ObjectStore,
    UnsafeObjectError,
    WrittenObject,
    is_segment,
    validate_key,
    validate_name,
)

__all__ = [
    "NAME_RULE",
    "HashingWriter",
    "ObjectStore",
    "UnsafeObjectError",
    "WrittenObject",
    "is_segment",
    "open_store",
    "split_uri",
    "validate_key",
    "validate_name",
]

STORE_HELP = "use file:///absolute/path, a plain directory path, or s3://bucket/prefix"


def open_store(uri: str) -> ObjectStore:
    """The store that `uri` names; bad URIs raise ConfigError naming the URI."""
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(f"empty store URI: {STORE_HELP}")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in uri):
        # urlparse silently drops tabs and newlines: the store would be another than named.
        raise ConfigError(f"store URI {uri!r} contains control characters; {STORE_HELP}")
    try:
        parsed = urlparse(uri)
    except ValueError as e:
        raise ConfigError(f"store URI {uri!r} is malformed ({e}); {STORE_HELP}") from None
    if parsed.scheme in ("s3", "file") and (parsed.query or parsed.fragment or parsed.params):
        # urlparse would drop these silently and the store would be another one than named.
        raise ConfigError(f"store URI {uri!r} has a query or fragment ('?', '#', ';'); "
                          f"{STORE_HELP}")
    if parsed.scheme == "s3":
        from .s3 import S3Store

        if not parsed.netloc:
            raise ConfigError(f"store URI {uri!r} has no bucket: {STORE_HELP}")
        prefix = parsed.path.strip("/")
        if prefix:
            validate_key(prefix)
        return S3Store(parsed.netloc, prefix)
    from .local import LocalStore

    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"store URI {uri!r} names a host; {STORE_HELP}")
        return LocalStore(unquote(parsed.path))
    if parsed.scheme and len(parsed.scheme) > 1:  # 'c:' would be a drive letter
        raise ConfigError(f"store URI {uri!r} has unsupported scheme {parsed.scheme!r}: {STORE_HELP}")
    return LocalStore(os.path.abspath(os.path.expanduser(uri)))


def split_uri(uri: str) -> tuple[str, str]:
    """Split an object URI into (store URI, key) at the last '/checkpoints/' segment.

    Used for an explicit `--resume URI` that names a checkpoint directory or its manifest.
    """
    marker = "/checkpoints/"
    idx = uri.rfind(marker)
    if idx < 0:
        raise ConfigError(
            f"--resume {uri!r} does not name a checkpoint: expected "
            "<store>/<experiment>/<run>/checkpoints/step-NNNNNNNNN-<attempt>[/MANIFEST.json]"
        )
    head = uri[:idx]
    tail = uri[idx + len(marker):].strip("/")
    # head = <store>/<experiment>/<run>
    parts = head.rstrip("/").rsplit("/", 2)
    if len(parts) != 3 or not tail:
        raise ConfigError(f"--resume {uri!r} does not name a checkpoint under a store")
    store_uri, experiment, run = parts
    name = tail.split("/")[0]
    validate_name(experiment, f"experiment name in --resume {uri!r}")
    validate_name(run, f"run name in --resume {uri!r}")
    if not is_segment(name):
        raise ConfigError(f"--resume {uri!r} names checkpoint {name!r}, which is not a "
                          "checkpoint name (step-NNNNNNNNN-aN)")
    return store_uri, f"{experiment}/{run}/checkpoints/{name}"
