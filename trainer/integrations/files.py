"""A framework's own checkpoint files as one part of a session's checkpoint.

A framework that saves its state in files of its own (Hugging Face's `checkpoint-N/`,
Lightning's `.ckpt`) resumes from those files by its own code, which knows its state better
than any reader of ours. The part holds the bytes of the files the framework wrote at the
session's step, so they are committed, verified and retained by the commit protocol like
any state; restoring writes them back where the framework looks for them.

The bytes travel as uint8 tensors: `torch.load(weights_only=True)` reads them, and nothing
in them is unpickled by us (a framework's own pickles are unpickled by the framework, from
files whose hashes were verified).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..base.errors import ConfigError


class FrameworkFiles:
    """The files of one framework checkpoint (a directory, or one file) as a part. Restored,
    they go back under `home` (the framework's checkpoint folder) by the name they had."""

    def __init__(self, what: str, home: str | os.PathLike | None = None):
        self.what = what  # the framework's name, for messages
        self.home = Path(home) if home is not None else None
        self.source: Path | None = None  # what the framework wrote last, and at which step
        self.source_step: int | None = None

    def wrote(self, path: str | os.PathLike, step: int) -> None:
        """The framework wrote its checkpoint of step `step` at `path`."""
        self.source, self.source_step = Path(path), step

    def state_dict(self) -> dict[str, Any]:
        if self.source is None or not self.source.exists():
            raise ConfigError(
                f"a checkpoint was due before {self.what} wrote one (nothing at "
                f"{self.source}); commit only from the framework's own save")
        files = ([self.source] if self.source.is_file()
                 else sorted(p for p in self.source.rglob("*") if p.is_file()))
        return {"step": self.source_step, "name": self.source.name,
                "files": {str(p.relative_to(self.source.parent)): _as_tensor(p.read_bytes())
                          for p in files}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.home is None:
            raise ConfigError(f"{self.what}: the folder to restore its checkpoint into is "
                              "not set; restore through the integration")
        for rel, data in state["files"].items():
            _write_atomically(self.home / rel, data.numpy().tobytes())
        self.wrote(self.home / state["name"], int(state["step"]))


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a framework never reads half a file of ours."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
