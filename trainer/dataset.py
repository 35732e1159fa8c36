"""Datasets by reference: a URI and a content manifest, never a copy of the bytes.

A dataset is a local file or directory, or an `s3://bucket/prefix`. Its manifest lists
every file with its size and SHA-256 (local) or size and ETag / SHA-256 checksum (S3, where
hashing would mean downloading everything); its version is the SHA-256 of that list. One
changed byte in one file changes the version, and a resume on another version is refused
(`check_same_data`): resuming on different data is not a resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from trainer.errors import ConfigError, StorageError


@dataclass(frozen=True)
class DatasetManifest:
    uri: str
    files: dict[str, dict[str, Any]]  # relative path -> {"size", "sha256" | "etag"}

    @property
    def version(self) -> str:
        body = json.dumps(self.files, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(body).hexdigest()

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri, "version": self.version, "files": self.files}


def local_path(uri: str) -> Path | None:
    """The local path a dataset URI names, or None for S3."""
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        return None
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme and len(parsed.scheme) > 1:
        raise ConfigError(f"dataset URI {uri!r} has unsupported scheme {parsed.scheme!r}: use "
                          "a local path, file:///abs/path or s3://bucket/prefix")
    return Path(uri).expanduser().absolute()


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _local_manifest(uri: str, root: Path) -> DatasetManifest:
    try:
        st = os.stat(root)
    except FileNotFoundError:
        raise ConfigError(f"dataset {uri} does not exist; fix the config's 'dataset' or "
                          "create the data first") from None
    except OSError as e:
        raise ConfigError(f"dataset {uri} cannot be read: {e.strerror}") from None
    try:
        if stat.S_ISREG(st.st_mode):
            return DatasetManifest(uri, {root.name: {"size": st.st_size, "sha256": _sha256(root)}})
        files = {}
        for dirpath, dirnames, filenames in os.walk(root, onerror=_raise):
            dirnames.sort()
            for name in sorted(filenames):
                p = Path(dirpath, name)
                rel = p.relative_to(root).as_posix()
                files[rel] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    except OSError as e:
        raise ConfigError(f"dataset {uri}: {e.filename or ''} cannot be read "
                          f"({e.strerror}); fix its permissions or the config's 'dataset'") from None
    if not files:
        raise ConfigError(f"dataset {uri} is an empty directory")
    return DatasetManifest(uri, files)


def _raise(e: OSError) -> None:
    raise e


def _s3_manifest(uri: str, client=None) -> DatasetManifest:
    from botocore.exceptions import BotoCoreError, ClientError

    from trainer.storage.s3 import default_client

    parsed = urlparse(uri)
    bucket, prefix = parsed.netloc, parsed.path.lstrip("/")
    client = client or default_client()
    files: dict[str, dict[str, Any]] = {}
    try:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix):].lstrip("/") or obj["Key"].rsplit("/", 1)[-1]
                entry = {"size": int(obj["Size"]), "etag": obj["ETag"].strip('"')}
                if obj.get("ChecksumAlgorithm") == ["SHA256"] and obj.get("ChecksumSHA256"):
                    entry["sha256_b64"] = obj["ChecksumSHA256"]
                files[rel] = entry
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchBucket", "AccessDenied", "403", "404"):
            raise ConfigError(f"dataset {uri} cannot be listed ({code}); check the bucket "
                              "name and the credentials") from None
        raise StorageError(f"dataset {uri} could not be listed: {e}") from e
    except BotoCoreError as e:
        raise StorageError(f"dataset {uri} could not be listed: {e}") from e
    if not files:
        raise ConfigError(f"dataset {uri} holds no objects; fix the config's 'dataset' or "
                          "upload the data first")
    return DatasetManifest(uri, files)


def dataset_manifest(uri: str, s3_client=None) -> DatasetManifest:
    """The content manifest of the dataset at `uri` (ConfigError if missing or unreadable)."""
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError("the dataset URI is empty: use a path, file:///abs/path or "
                          "s3://bucket/prefix")
    path = local_path(uri)
    return _s3_manifest(uri, s3_client) if path is None else _local_manifest(uri, path)


def check_same_data(checkpoint_version: str | None, current_version: str | None,
                    checkpoint_uri: str) -> None:
    """Refuse to resume a checkpoint trained on other data than the run's data is now."""
    if checkpoint_version and current_version and checkpoint_version != current_version:
        raise ConfigError(
            f"the dataset changed: checkpoint {checkpoint_uri} was trained on data version "
            f"{checkpoint_version[:16]}, the dataset is now version {current_version[:16]}. "
            "Resuming on different data is not a resume: restore the original data, or "
            "register a new training run for the new data."
        )
