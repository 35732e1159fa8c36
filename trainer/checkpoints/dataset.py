"""Datasets by reference: a URI and a content manifest, never a copy of the bytes.

A dataset is a local file or directory, or an `s3://bucket/prefix`. Its manifest lists
every file with its size and SHA-256 (local) or size and ETag / SHA-256 checksum (S3, where
hashing would mean downloading everything); its version is the SHA-256 of that list. One
changed byte in one file changes the version, and a resume on another version is refused
(`check_same_data`): resuming on different data is not a resume.

Versioning reads regular files only and never blocks: a FIFO, socket or device in a local
dataset is refused naming the entry (bad input), and so is a symlink that leaves the
dataset. A symlink to a file inside the dataset is followed (hashed under the link's name);
a symlink to a directory inside it is not walked, since its files are versioned under
their own paths already.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from ..base import strict_json
from ..base.errors import ConfigError, StorageError


@dataclass(frozen=True)
class DatasetManifest:
    uri: str
    files: dict[str, dict[str, Any]]  # relative path -> {"size", "sha256" | "etag"}

    @property
    def version(self) -> str:
        body = strict_json.dumps(self.files, sort_keys=True, separators=(",", ":")).encode()
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


# What a dataset entry that is not a regular file is, for the message that refuses it.
_SPECIAL = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
            (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _kind(mode: int) -> str:
    return next((word for test, word in _SPECIAL if test(mode)), "not a regular file")


def _not_regular(uri: str, rel: str, what: str) -> ConfigError:
    if not rel:
        return ConfigError(f"dataset {uri} is {what}; a dataset is a regular file or a "
                           "directory of them: fix the config's 'dataset'")
    return ConfigError(
        f"dataset {uri}: entry {rel!r} is {what}; a dataset holds regular files only (reading "
        "anything else can block for ever or never end). Remove it from the dataset, or "
        "point the config's 'dataset' at a directory of regular files")


def _described(path: str) -> str:
    """`path` and what it is: '/dev/zero (a character device)'."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        return f"{path} ({e.strerror.lower()})"
    what = "a file" if stat.S_ISREG(mode) else "a directory" if stat.S_ISDIR(mode) else _kind(mode)
    return f"{path} ({what})"


def _hashed(uri: str, path: str, rel: str) -> dict[str, Any]:
    """Size and SHA-256 of the regular file at `path`; anything else is refused, never read.

    O_NOFOLLOW | O_NONBLOCK: opening cannot follow a link swapped in after the walk looked,
    nor wait for a FIFO's writer; the type is checked again on what was opened."""
    fd = os.open(path, _OPEN_FLAGS)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(uri, rel, _kind(st.st_mode))
        return {"size": st.st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _link_entry(uri: str, root: str, path: str, rel: str) -> dict[str, Any] | None:
    """A symlink inside the dataset: its file's entry (None: a directory, not walked)."""
    target = os.path.realpath(path)
    if os.path.commonpath([root, target]) != root:
        raise ConfigError(
            f"dataset {uri}: entry {rel!r} is a symlink to {_described(target)}, outside "
            "the dataset; "
            "versioning does not follow links out of the dataset. Copy the file into the "
            "dataset or point the config's 'dataset' at the directory that holds it")
    st = os.stat(target)
    if stat.S_ISDIR(st.st_mode):
        return None  # its files are versioned under their own paths in the dataset
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(uri, rel, f"a symlink to {_kind(st.st_mode)} ({target})")
    return _hashed(uri, target, rel)


def _walk(uri: str, root: str) -> dict[str, dict[str, Any]]:
    """Every regular file under `root` (resolved) by its path relative to it, never
    following a symlink out of the dataset, never opening anything but a regular file."""
    files: dict[str, dict[str, Any]] = {}
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        with os.scandir(os.path.join(root, rel_dir)) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                pending.append(rel)
            elif stat.S_ISLNK(mode):
                linked = _link_entry(uri, root, entry.path, rel)
                if linked is not None:
                    files[rel] = linked
            elif stat.S_ISREG(mode):
                files[rel] = _hashed(uri, entry.path, rel)
            else:
                raise _not_regular(uri, rel, _kind(mode))
    return dict(sorted(files.items()))


def _local_manifest(uri: str, root: Path) -> DatasetManifest:
    try:
        st = os.stat(root)  # the dataset's own path may be a link (/data/current -> v3)
    except FileNotFoundError:
        raise ConfigError(f"dataset {uri} does not exist; fix the config's 'dataset' or "
                          "create the data first") from None
    except OSError as e:
        raise ConfigError(f"dataset {uri} cannot be read: {e.strerror}") from None
    real = os.path.realpath(root)
    try:
        if stat.S_ISREG(st.st_mode):
            return DatasetManifest(uri, {root.name: _hashed(uri, real, "")})
        if not stat.S_ISDIR(st.st_mode):
            raise _not_regular(uri, "", _kind(st.st_mode))
        files = _walk(uri, real)
    except OSError as e:
        raise ConfigError(f"dataset {uri}: {e.filename or ''} cannot be read "
                          f"({e.strerror}); fix its permissions or the config's 'dataset'") from None
    if not files:
        raise ConfigError(f"dataset {uri} is an empty directory")
    return DatasetManifest(uri, files)


def _s3_manifest(uri: str, client=None) -> DatasetManifest:
    from botocore.exceptions import BotoCoreError, ClientError

    from ..storage.s3 import default_client

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
