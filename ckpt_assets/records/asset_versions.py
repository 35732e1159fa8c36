"""Versions of asset values in the checkpoint store, kept with the trainer's commit protocol.

    <store>/<experiment>/<run>/assets/<asset>/v-000001/value.pt|value.json + MANIFEST.json
    <store>/<experiment>/<run>/assets/<asset>/latest.json        pointer, moved last
    <store>/<experiment>/<run>/models/v-000001/model.pt + MANIFEST.json   (final_model)

Each value is a new version: its payload is written create-once, then MANIFEST.json (size
and SHA-256 of every file) create-once, then latest.json moves by a conditional write. The
keys are a `trainer.checkpoints.layout.RunLayout` whose versions directory is the asset's, and writing,
reading and verifying are the functions `trainer.checkpoints.repo.CheckpointRepo` is built on, so there
is exactly one commit protocol in the project. Nothing is overwritten in place: a kill
before the manifest leaves an invisible orphan, a kill before the pointer leaves the
previous version current.

The IO manager stores and loads values through `VersionedRepo`; the asset checks and the
lineage report read the final model's versions with it.
"""

from __future__ import annotations

import io
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from trainer.base.errors import AlreadyExistsError, CheckpointError, CheckpointNotFoundError
from trainer.checkpoints import verification
from trainer.checkpoints.commit import (
    Pending,
    committed_pointer,
    move_pointer,
    write_file,
    write_manifest,
)
from trainer.checkpoints.layout import RunLayout, committed, read_pointer, read_pointer_versioned
from trainer.checkpoints.manifest import MANIFEST, Manifest
from trainer.checkpoints.pointer import Pointer
from trainer.storage import ObjectStore

_VERSION_RE = re.compile(r"^v-(\d{6,})$")


class StoredObjectError(CheckpointError):
    """A stored asset value is missing, corrupt or unreadable; it was not loaded."""


def version_name(version: int) -> str:
    return f"v-{version:06d}"


@dataclass
class PendingVersion(Pending):
    """A version being written, with the pointer it was begun against: that pointer's
    version is its parent, and its token is what the pointer's move is conditional on."""

    base: Pointer | None = None
    token: str | None = None

    @property
    def parent(self) -> str | None:
        return self.base.checkpoint if self.base else None


class VersionedRepo:
    """The versions `v-NNNNNN` of one value of a training run, under `subdir`."""

    def __init__(self, store: ObjectStore, experiment: str, run: str, subdir: str):
        self.layout = RunLayout(store, experiment, run, versions=subdir)
        self.owner = uuid.uuid4().hex[:12]

    @property
    def store(self) -> ObjectStore:
        return self.layout.store

    @property
    def experiment(self) -> str:
        return self.layout.experiment

    @property
    def run(self) -> str:
        return self.layout.run

    @staticmethod
    def version_name(version: int) -> str:
        return version_name(version)

    def key(self, name: str, filename: str | None = None) -> str:
        return self.layout.key(name, filename)

    def uri(self, name: str) -> str:
        return self.layout.uri(name)

    # -- discovery ------------------------------------------------------------------------
    def list_names(self) -> list[str]:
        """Version names (committed or not), oldest first."""
        prefix = self.layout.versions_prefix
        names = set()
        for key in self.store.list(prefix):
            head = key[len(prefix) + 1:].split("/")[0]
            if _VERSION_RE.match(head):
                names.add(head)
        return sorted(names, key=lambda n: int(n[2:]))

    def committed(self) -> list[str]:
        """Versions that have a manifest, oldest first."""
        return committed(self.layout, self.list_names())

    def next_version(self) -> int:
        names = self.list_names()
        return int(names[-1][2:]) + 1 if names else 1

    def read_pointer(self) -> Pointer | None:
        return read_pointer(self.layout)

    def current(self) -> str | None:
        ptr = self.read_pointer()
        return ptr.checkpoint if ptr else None

    def read_manifest(self, name: str) -> Manifest:
        return verification.read_manifest(self.layout, name)

    # -- writing --------------------------------------------------------------------------
    def put(self, filename: str, payload: bytes, meta: dict[str, Any],
            retries: int = 5) -> Manifest:
        """Commit `payload` as a new version; a lost race for a version name takes the next.
        Its parent is the version latest.json named when this write began."""
        base, token = read_pointer_versioned(self.layout)
        for _ in range(retries):
            version = self.next_version()
            pending = PendingVersion(version_name(version), version, 0, base=base, token=token)
            try:
                with write_file(self.layout, pending, filename) as w:
                    w.write(payload)
            except AlreadyExistsError:
                continue
            return self.commit(pending, meta)
        raise StoredObjectError(f"could not find a free version name under "
                                f"{self.store.uri_for(self.layout.versions_prefix)} after "
                                f"{retries} tries")

    def commit(self, pending: PendingVersion, meta: dict[str, Any]) -> Manifest:
        """Manifest last inside the version, then the pointer (conditional on `pending`'s
        base: a writer that moved it since loses)."""
        manifest = write_manifest(self.layout, pending, pending.parent, meta)
        move_pointer(self.layout, pending.base, pending.token, self.owner,
                     **committed_pointer(pending.base, pending, meta))
        return manifest

    # -- loading --------------------------------------------------------------------------
    def load_current(self) -> tuple[Any, Manifest]:
        """Verify, then deserialize, the version latest.json names."""
        where = self.store.uri_for(self.layout.versions_prefix)
        try:
            name = self.current()
        except CheckpointError as e:
            raise StoredObjectError(f"cannot load from {where}: {e}") from e
        if name is None:
            raise StoredObjectError(
                f"nothing is stored at {where} (no committed version); materialize the asset "
                "for this partition first")
        try:
            m, filename, fmt, data = self._verified(name)
        except (CheckpointError, CheckpointNotFoundError) as e:
            raise StoredObjectError(
                f"refusing to load version {name} from {where}: {e}. Nothing was deserialized; "
                "re-materialize the asset for this partition") from e
        if fmt == "json":
            return json.loads(data), m
        from trainer.api.state_files import safe_torch_load

        return safe_torch_load(io.BytesIO(data), self.layout.uri(name, filename)), m

    def _verified(self, name: str) -> tuple[Manifest, str, str, bytes]:
        """(manifest, filename, format, bytes) of version `name`, the bytes verified."""
        m = self.read_manifest(name)
        filename, fmt = m.meta.get("filename"), m.meta.get("format")
        if filename not in m.files or fmt not in ("json", "torch"):
            raise CheckpointError(f"manifest {self.layout.uri(name, MANIFEST)} "
                                  "does not describe a stored asset value")
        try:
            data = self.store.read_bytes(self.key(name, filename))
        except FileNotFoundError as e:
            raise CheckpointError(f"file {self.layout.uri(name, filename)} listed in its "
                                  "manifest is missing") from e
        verification.verify_file(self.layout, m, filename, io.BytesIO(data))
        return m, filename, fmt, data
