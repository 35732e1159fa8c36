"""The manifest: what makes a checkpoint exist, and the names checkpoints go by.

`MANIFEST.json` is written last inside a checkpoint and lists every file with its size
and SHA-256 (per-chunk digests for large files), the step, the attempt, the parent and the
experiment and run it belongs to. Everything read back is checked strictly, so a damaged
or crafted manifest is a `CheckpointError` that discovery walks past, never a crash.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from ..base import strict_json
from ..base.errors import CheckpointError
from ..storage import WrittenObject, is_segment
from ..storage.base import CHUNK_SIZE

MANIFEST = "MANIFEST.json"
FORMAT_VERSION = 1
# Checkpoint names carry the step in nine digits (so that they sort by name): the highest
# step a run can reach.
MAX_STEP = 10**9 - 1
_NAME_RE = re.compile(r"step-([0-9]{9})-a([0-9]{1,9})(-end)?")
# The run's end at a step its attempt committed already (a trigger fired on the last step,
# before the script's post-loop work): committed again, as the script left it, under the
# step's name and this suffix, since a committed checkpoint is never rewritten.
END_SUFFIX = "-end"
END_AGAIN = "end_again"  # the meta key that asks the checkpointer for that name
_HEX64 = re.compile(r"[0-9a-f]{64}")


def checkpoint_name(step: int, attempt: int, end: bool = False) -> str:
    return f"step-{step:09d}-a{attempt}{END_SUFFIX if end else ''}"


def parse_checkpoint_name(name: str) -> tuple[int, int, bool] | None:
    """(step, attempt, end) of a checkpoint's name, in the order checkpoints follow."""
    m = _NAME_RE.fullmatch(name) if isinstance(name, str) else None
    return (int(m.group(1)), int(m.group(2)), m.group(3) is not None) if m else None


def file_entry(w: WrittenObject) -> dict[str, Any]:
    entry: dict[str, Any] = {"size": w.size, "sha256": w.sha256}
    if w.chunks:
        entry.update(chunk_size=CHUNK_SIZE, chunks=list(w.chunks))
    return entry


@dataclass
class Manifest:
    name: str
    step: int
    attempt: int
    files: dict[str, dict[str, Any]]
    parent: str | None
    created_at: float
    meta: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    # The run the checkpoint was written for: a copy under another run's name is refused.
    # None only in manifests written before these were recorded.
    experiment: str | None = None
    run: str | None = None

    def to_json(self) -> bytes:
        return strict_json.dumps(self.__dict__, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and check a manifest; anything malformed raises CheckpointError (the
        checkpoint is then walked past like a corrupt one)."""
        try:
            raw = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"manifest {where} is unreadable ({e}); it is corrupt") from e
        if isinstance(raw, dict) and raw.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
            raise CheckpointError(
                f"manifest {where} has format version {raw.get('format_version')!r}; this "
                f"trainer reads version {FORMAT_VERSION}. Resume with a matching trainer version."
            )
        try:
            return cls._checked(raw)
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointError(
                f"manifest {where} is malformed ({e}); it is corrupt or was not written by "
                "this trainer"
            ) from e

    @classmethod
    def _checked(cls, raw: Any) -> Manifest:
        if not isinstance(raw, dict):
            raise TypeError("not a JSON object")
        files = checked_type(raw["files"], dict, "files")
        if not files:
            raise ValueError("it lists no files")
        for filename, entry in files.items():
            if not is_segment(filename) or filename == MANIFEST:
                raise ValueError(f"file name {filename!r} is not a plain file name")
            _check_file_entry(filename, checked_type(entry, dict, f"files[{filename!r}]"))
        created = checked_type(raw["created_at"], (int, float), "created_at")
        if not math.isfinite(created):
            raise ValueError(f"created_at is {created!r}")
        return cls(
            name=checked_name(raw["name"], "name"),
            step=checked_count(raw["step"], "step"),
            attempt=checked_count(raw["attempt"], "attempt"),
            files=files,
            parent=checked_name(raw.get("parent"), "parent", optional=True),
            created_at=created,
            meta=checked_type(raw.get("meta", {}), dict, "meta"),
            format_version=checked_type(raw.get("format_version", FORMAT_VERSION), int,
                                  "format_version"),
            experiment=checked_type(raw.get("experiment"), str, "experiment", optional=True),
            run=checked_type(raw.get("run"), str, "run", optional=True),
        )

    @property
    def total_size(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())

    @property
    def sha256(self) -> str:
        """One digest for the whole checkpoint: the hash of its manifest's file list."""
        body = strict_json.dumps(self.files, sort_keys=True).encode()
        return hashlib.sha256(body).hexdigest()


def _check_file_entry(filename: str, entry: dict[str, Any]) -> None:
    size = checked_count(entry["size"], f"{filename}.size")
    if not (isinstance(entry["sha256"], str) and _HEX64.fullmatch(entry["sha256"])):
        raise ValueError(f"{filename}.sha256 is {entry['sha256']!r}, not a SHA-256 hex digest")
    if "chunks" not in entry and "chunk_size" not in entry:
        return
    chunk_size = checked_type(entry.get("chunk_size", CHUNK_SIZE), int, f"{filename}.chunk_size")
    if chunk_size <= 0:
        raise ValueError(f"{filename}.chunk_size is {chunk_size}; it must be positive")
    chunks = checked_type(entry.get("chunks"), list, f"{filename}.chunks")
    if not all(isinstance(c, str) and _HEX64.fullmatch(c) for c in chunks):
        raise ValueError(f"{filename}.chunks holds something that is not a SHA-256 hex digest")
    want = max(1, -(-size // chunk_size))
    if len(chunks) != want:
        raise ValueError(f"{filename} lists {len(chunks)} chunk digests; {size} bytes in "
                         f"chunks of {chunk_size} make {want}")


def checked_type(value: Any, tp: type | tuple[type, ...], what: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, tp) or isinstance(value, bool):
        names = "/".join(t.__name__ for t in (tp if isinstance(tp, tuple) else (tp,)))
        raise TypeError(f"{what} is {value!r}, expected {names}")
    return value


def checked_count(value: Any, what: str, optional: bool = False) -> Any:
    n = checked_type(value, int, what, optional)
    if n is not None and n < 0:
        raise ValueError(f"{what} is {n}; it cannot be negative")
    return n


def checked_name(value: Any, what: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not is_segment(value):
        raise ValueError(f"{what} is {value!r}, not a plain checkpoint name")
    return value
