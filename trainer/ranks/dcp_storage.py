"""`torch.distributed.checkpoint` (DCP) over the project's object store and commit protocol.

DCP saves sharded state (FSDP2's DTensors) with every rank writing its own shards and one
coordinator writing the metadata that says which bytes hold which slice of which tensor;
on load, each rank reads the slices its own shards need, whatever the world size that
wrote them (that is DCP's resharding). `StoreWriter` and `StoreReader` are the storage
layer under it, so a DCP checkpoint is committed like every other one:

* each rank's bytes go into one create-once object of the pending checkpoint,
  `sharded-rank{r}.distcp`, hashed as it is written; the coordinator's metadata into
  `sharded-metadata.pt`. Both land in `Pending.written`, so the manifest (written last, by
  rank 0, after the barrier) lists them with their SHA-256 like any rank file;
* the reader verifies every object's size and SHA-256 against the manifest before a byte of
  it is interpreted, so discovery's walk-back skips a broken DCP checkpoint as it skips any.

The format is ours, not DCP's `FileSystemWriter`'s, for two reasons. Tensors are written as
their raw bytes (dtype and shape recorded beside the offset), so reading a shard
deserializes nothing. And DCP's own metadata file is a plain pickle, which the project never
loads (`torch.load(weights_only=True)` only): ours is written with `torch.save` and read
with the safe loader, allowing DCP's metadata classes and nothing else. Non-tensor values
(an optimizer's hyperparameters) are DCP's small `torch.save` blobs, refused unless the
safe loader accepts them.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..base.errors import CheckpointError
from ..checkpoints.commit import Pending
from ..checkpoints.manifest import Manifest
from ..checkpoints.repo import CheckpointRepo

METADATA_FILE = "sharded-metadata.pt"
NO_DIST_WARNING = "torch.distributed is disabled, unavailable or uninitialized"
# The classes DCP's metadata is made of: all the safe loader may build from that file.
METADATA_CLASSES = [
    dcp_metadata.Metadata, dcp_metadata.MetadataIndex, dcp_metadata.TensorStorageMetadata,
    dcp_metadata.ChunkStorageMetadata, dcp_metadata.TensorProperties,
    dcp_metadata.BytesStorageMetadata, dcp_metadata.StorageMeta,
    dcp_metadata._MEM_FORMAT_ENCODING, torch.Size,
]


def shard_file(rank: int) -> str:
    return f"sharded-rank{rank}.distcp"


def is_sharded(manifest: Manifest) -> bool:
    """Does the checkpoint hold state saved through DCP?"""
    return METADATA_FILE in manifest.files


# Where one item's bytes are: (file, offset, length, dtype name or None for a blob, shape).
# A tuple of plain values, so the metadata holds nothing but DCP's own classes.
Location = tuple[str, int, int, str | None, tuple[int, ...]]


class StoreWriter(StorageWriter):
    """DCP's storage writer into one pending checkpoint of `repo` (module docstring)."""

    def __init__(self, repo: CheckpointRepo, pending: Pending):
        super().__init__()
        self.repo, self.pending = repo, pending
        self.is_coordinator = False

    def reset(self, checkpoint_id: Any = None) -> None:
        pass  # where to write is the pending checkpoint, fixed at construction

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # never picked by DCP from a path: pass it as storage_writer

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # The coordinator numbers the plans: each rank's objects get names no other rank uses.
        return [dataclasses.replace(p, storage_data=i) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        filename = shard_file(plan.storage_data)
        results: list[WriteResult] = []
        offset = 0
        with self.repo.write_file(self.pending, filename) as w:
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    buf, dtype, shape = data.getbuffer(), None, ()
                else:
                    t = data.detach().to("cpu").contiguous()
                    buf, dtype, shape = _raw_bytes(t), str(t.dtype).removeprefix("torch."), \
                        tuple(t.shape)
                w.write(buf)
                where: Location = (filename, offset, len(buf), dtype, shape)
                results.append(WriteResult(item.index, len(buf), where))
                offset += len(buf)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: dcp_metadata.Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: the metadata, with where every item lies, as one more object."""
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        buf = io.BytesIO()
        torch.save(metadata, buf)
        with self.repo.write_file(self.pending, METADATA_FILE) as w:
            w.write(buf.getbuffer())


def _raw_bytes(t: torch.Tensor) -> memoryview:
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


class StoreReader(StorageReader):
    """DCP's storage reader of one committed checkpoint; every object verified first."""

    def __init__(self, repo: CheckpointRepo, manifest: Manifest):
        super().__init__()
        self.repo, self.manifest = repo, manifest
        self.locations: dict[Any, Location] = {}
        self._metadata: dcp_metadata.Metadata | None = None

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        """The verified metadata (read once: callers check it before DCP asks for it, so
        a broken checkpoint is our CheckpointError, not DCP's wrapped assertion)."""
        if self._metadata is None:
            self._metadata = self._read_metadata()
        return self._metadata

    def _read_metadata(self) -> dcp_metadata.Metadata:
        if not is_sharded(self.manifest):
            raise CheckpointError(
                f"checkpoint {self.repo.uri(self.manifest.name)} holds no sharded state (it "
                "was written by a model that was not fully_shard-ed); resume it with the "
                "model unsharded, or start a new run")
        data = self._verified(METADATA_FILE)
        try:
            with torch.serialization.safe_globals(METADATA_CLASSES):
                metadata = torch.load(io.BytesIO(data), weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
            raise CheckpointError(f"{self._uri(METADATA_FILE)} is not DCP metadata this "
                                  f"trainer reads: {str(e).splitlines()[0]}") from e
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointError(f"{self._uri(METADATA_FILE)} holds no DCP metadata")
        return metadata

    def set_up_storage_reader(self, metadata: dcp_metadata.Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        self.locations = metadata.storage_data or {}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.locations[item.storage_index][0], []).append(item)
        for filename, items in by_file.items():
            data = memoryview(self._verified(filename))
            for item in items:
                _, offset, length, dtype, shape = self.locations[item.storage_index]
                chunk = data[offset:offset + length]
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(self._safe_blob(chunk, filename)))
                else:
                    self._load_tensor(planner, item, _from_raw(chunk, dtype, shape))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _load_tensor(planner: LoadPlanner, item: ReadItem, stored: torch.Tensor) -> None:
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths,
                                                  strict=True)):
            stored = stored.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        target.copy_(stored)
        planner.commit_tensor(item, target)

    def _safe_blob(self, chunk: memoryview, filename: str) -> bytes:
        """A non-tensor value's bytes, once the safe loader accepted them."""
        blob = bytes(chunk)
        try:
            torch.load(io.BytesIO(blob), weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
            raise CheckpointError(
                f"{self._uri(filename)} holds a value the safe loader refuses (it may carry "
                f"code that would run on load); not loaded: {str(e).splitlines()[0]}") from e
        return blob

    def _verified(self, filename: str) -> bytes:
        """The object's bytes, after its size and SHA-256 matched the manifest."""
        if filename not in self.manifest.files:
            raise CheckpointError(f"checkpoint {self.repo.uri(self.manifest.name)} lists no "
                                  f"{filename}; it is incomplete")
        try:
            f = self.repo.store.open_read(self.repo.key(self.manifest.name, filename))
        except FileNotFoundError as e:
            raise CheckpointError(f"checkpoint file {self._uri(filename)} is missing") from e
        with f:
            self.repo.verify_file(self.manifest, filename, f)
            f.seek(0)
            return f.read()

    def _uri(self, filename: str) -> str:
        return self.repo.store.uri_for(self.repo.key(self.manifest.name, filename))


def _from_raw(chunk: memoryview, dtype: str | None, shape: tuple[int, ...]) -> torch.Tensor:
    kind = getattr(torch, dtype or "", None)
    if not isinstance(kind, torch.dtype):
        raise CheckpointError(f"sharded state names dtype {dtype!r}, which is not a torch dtype")
    flat = torch.frombuffer(bytearray(chunk), dtype=torch.uint8) if len(chunk) else \
        torch.empty(0, dtype=torch.uint8)
    return flat.view(kind).reshape(shape)


class _SafeBytes:
    """Non-tensor values read by the safe loader (DCP's planners read them with
    `weights_only=False`)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(_SafeBytes, DefaultLoadPlanner):
    """DCP's default load planner (into a state dict of the right shapes), safely."""


class WholeStatePlanner(_SafeBytes, _EmptyStateDictLoadPlanner):
    """Builds the whole state from the metadata alone (no model needed), safely."""


def read_whole(repo: CheckpointRepo, manifest: Manifest) -> dict[str, Any]:
    """The checkpoint's sharded parts as whole tensors, read by this process alone (no
    process group, no model): to export a model, or to compare two checkpoints."""
    # DCP's public `load` fills only the keys the caller's dict already has; building the
    # state from the metadata takes its inner loader (what DCP's own dcp_to_torch_save uses).
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader = StoreReader(repo, manifest)
    reader.read_metadata()
    with warnings.catch_warnings(), the_cause(0):  # one process is the point here
        warnings.filterwarnings("ignore", message=NO_DIST_WARNING)
        _load_state_dict(state, storage_reader=reader, planner=WholeStatePlanner(),
                         no_dist=True)
    return state


@contextmanager
def the_cause(rank: int) -> Iterator[None]:
    """DCP gathers every rank's failure into one CheckpointException (a BaseException,
    which no `except Exception` sees): raise the cause instead, this rank's own first, so a
    store that failed on one rank fails every rank as a storage error."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        failures = e.failures
        exc, _trace = failures.get(rank) or next(iter(failures.values()))
        raise exc from None
