"""What the layers below `defs/` need of the checkpoint store resource: a way to open it.

`defs.resources.CheckpointStore` is the Dagster resource that satisfies this; the domain
code takes anything with `open()`, so it never imports `defs/` (and tests hand it a plain
store)."""

from __future__ import annotations

from typing import Protocol

from trainer.storage import ObjectStore


class StoreSource(Protocol):
    def open(self) -> ObjectStore: ...
