"""Where one training run's objects live inside a store, and reading what is there.

    <experiment>/<run>/checkpoints/step-000000120-a2/   payload file(s) + MANIFEST.json
    <experiment>/<run>/checkpoints/latest.json          pointer, moved last
    <experiment>/<run>/heartbeat.json                   the live attempt's heartbeat
    <experiment>/<run>/configs/<sha256>.json            configs the run's attempts ran with

`RunLayout` is a value: it names the keys and holds no state, so the commit protocol's
reading, verification and retention are functions over it (`trainer.checkpoints.verification`,
`trainer.checkpoints.retention`). `trainer.checkpoints.repo.CheckpointRepo` adds the one writer's state (the
pointer version it last saw, the checkpoint it descends from) on top.

The same protocol keeps other lines of create-once versions of a run, each directory with
its own latest.json (`versions`, e.g. `assets/<asset>` or `models`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..storage import ObjectStore, validate_key, validate_name
from .manifest import MANIFEST, parse_checkpoint_name
from .pointer import Pointer

CHECKPOINTS = "checkpoints"
POINTER = "latest.json"
HEARTBEAT = "heartbeat.json"
CONFIGS = "configs"


@dataclass(frozen=True)
class RunLayout:
    """The keys of one training run in `store`; names are validated on construction."""

    store: ObjectStore
    experiment: str
    run: str
    # The directory of versions and its pointer: the run's checkpoints, or another line of
    # versions kept with the same commit protocol.
    versions: str = CHECKPOINTS

    def __post_init__(self) -> None:
        validate_name(self.experiment, "experiment name")
        validate_name(self.run, "run name")
        validate_key(self.versions)

    @property
    def prefix(self) -> str:
        return f"{self.experiment}/{self.run}"

    @property
    def versions_prefix(self) -> str:
        return f"{self.prefix}/{self.versions}"

    @property
    def pointer_key(self) -> str:
        return f"{self.versions_prefix}/{POINTER}"

    @property
    def heartbeat_key(self) -> str:
        return f"{self.prefix}/{HEARTBEAT}"

    @property
    def configs_prefix(self) -> str:
        return f"{self.prefix}/{CONFIGS}"

    def key(self, name: str, filename: str | None = None) -> str:
        """Key of version `name`'s directory, or of one of its files."""
        k = f"{self.versions_prefix}/{name}"
        return f"{k}/{filename}" if filename else k

    def uri(self, name: str, filename: str | None = None) -> str:
        return self.store.uri_for(self.key(name, filename))

    @property
    def pointer_uri(self) -> str:
        return self.store.uri_for(self.pointer_key)


def read_pointer_versioned(layout: RunLayout) -> tuple[Pointer | None, str | None]:
    """The pointer (None if there is none) and its version token, for a conditional move.
    An unreadable pointer raises CheckpointError."""
    data, token = layout.store.read_versioned(layout.pointer_key)
    if data is None:
        return None, token
    return Pointer.from_json(data, layout.pointer_uri), token


def read_pointer(layout: RunLayout) -> Pointer | None:
    return read_pointer_versioned(layout)[0]


def list_names(layout: RunLayout) -> list[str]:
    """Names of checkpoint directories (committed or not), oldest first."""
    prefix = layout.versions_prefix
    names = set()
    for key in layout.store.list(prefix):
        rest = key[len(prefix) + 1:]
        if "/" in rest and parse_checkpoint_name(rest.split("/")[0]):
            names.add(rest.split("/")[0])
    return sorted(names, key=lambda n: parse_checkpoint_name(n))


def committed(layout: RunLayout, names: list[str] | None = None) -> list[str]:
    """Those of `names` (default: the checkpoints) that have a manifest, in their order."""
    keys = set(layout.store.list(layout.versions_prefix))
    return [n for n in (list_names(layout) if names is None else names)
            if layout.key(n, MANIFEST) in keys]


def read_heartbeat(layout: RunLayout) -> dict[str, Any] | None:
    data, _ = layout.store.read_versioned(layout.heartbeat_key)
    return json.loads(data) if data else None
