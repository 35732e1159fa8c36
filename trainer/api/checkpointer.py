"""Checkpointer: a dict of named stateful parts saved and restored as one checkpoint.

Parts are anything with `state_dict()` / `load_state_dict()`. `save` snapshots them and
persists the snapshot through the commit protocol (`trainer.checkpoints.repo`). With `async_save` the
training thread only takes the snapshot (`trainer.api.snapshot`: small state copied at once, the
optimizers' tensors copied into reused host buffers while the next forward and backward
run, fenced before the optimizer writes them) and the writing happens on a background
thread; at most one save is in flight, the next save (or `close`) waits for it, and its
error surfaces at the next step. A crash during a background save loses only that save:
the commit protocol is the same either way. `load` verifies every file's SHA-256 before
deserializing, and only ever with `torch.load(weights_only=True)`.

With several ranks (`trainer.ranks.distributed`) each rank writes its share of the parts and its
own RNG states to `state-rank{r}.pt`, and rank 0 commits once every rank's file is durable;
`load` reads every rank's file (the replicated parts are spread over them), each verified
again by the rank that reads it.
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import numpy as np
import torch

from ..base.errors import CheckpointError
from ..checkpoints.commit import Pending
from ..checkpoints.manifest import END_AGAIN, Manifest
from ..checkpoints.repo import CheckpointRepo
from ..checkpoints.retention import delete_checkpoint
from ..process.signals import on_a_helper_thread
from ..ranks.distributed import RNG_PART, Ranks, rank_file, rederive_rngs
from ..ranks.sharded import SHARDED_META, ShardedParts, Shards
from .parts import UNPICKLABLE, unsavable_error
from .snapshot import HostBuffers, Snapshot, owned_storages, owned_tensors, take
from .state_files import STATE_FILE, WORLD_SIZE, load_rank_state

log = logging.getLogger("trainer.checkpoint")

# How far a background write's threads step back from training (CPU weight about a third):
# enough for training to win a contended core, not so far that a busy host starves the write.
WRITER_NICENESS = 5


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class RNGState:
    """Python, NumPy, torch CPU and CUDA generators, in types the safe loader accepts."""

    def state_dict(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state = {
            "python": random.getstate(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["gauss"]))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    def __init__(self, repo: CheckpointRepo, parts: dict[str, Stateful], attempt: int,
                 keep_last: int = 3, keep_best: bool = True, async_save: bool = False,
                 ranks: Ranks | None = None, sharded: ShardedParts | None = None):
        self.repo = repo
        self.sharded = sharded  # FSDP2 parts, saved through DCP beside the rank files
        self.parts = parts
        self.ranks = ranks
        self.attempt = attempt
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.async_save = async_save
        # Behind a wrapper too (the session's parts measure their state): an optimizer not
        # found here gets no fence and no host buffers, and its whole state is copied on the
        # training thread.
        self._optimizers = [o for o in map(_unwrapped, parts.values())
                            if isinstance(o, torch.optim.Optimizer)]
        self._buffers = HostBuffers() if async_save else None
        self._hooks = [h for o in self._optimizers for h in (
            o.register_step_pre_hook(self._fence), o.register_step_post_hook(self._prepare))] \
            if async_save else []
        self._prepared = False
        self._snapshot: Snapshot | None = None
        # One worker, kept: a save hands it its copy without starting a thread, which
        # would wait on the training thread for the new thread's first run.
        self._worker = ThreadPoolExecutor(1, "checkpoint") if async_save else None
        self._job: Future | None = None  # the background save in flight, or not taken up
        self._error: BaseException | None = None
        self.last_saved_step: int | None = None
        self.on_commit = None  # callable(Manifest, stats dict), set by the loop

    # -- save ---------------------------------------------------------------------------
    def save(self, step: int, meta: dict[str, Any]) -> None:
        """Snapshot the parts at `step` and commit them (in the background if async).

        At most one save is in flight: this first waits for the previous one (and raises
        its error). The training thread's time in here, plus its wait at the optimizers'
        fence, is the save's stall (`blocking_seconds`)."""
        t0 = time.perf_counter()
        self.wait()
        if self.last_saved_step == step and not meta.get(END_AGAIN):
            return  # two triggers fired on one step: one checkpoint
        log.debug("saving step %d", step)
        state = {name: part.state_dict() for name, part in self._mine()}
        shards = self._shards()
        if self.async_save:
            try:
                snap = self._snapshot = take(state, owned_storages(self._optimizers))
            except UNPICKLABLE as e:  # its copy of a value that cannot be copied
                raise (unsavable_error(state, step, e) or e) from None
            del state  # the snapshot holds copies or the fenced originals, nothing else
            self._job = self._worker.submit(self._persist_bg, step, snap, shards, meta, t0,
                                            time.perf_counter() - t0)
        else:
            self._persist(step, state, shards, meta, t0, None)
        self.last_saved_step = step

    def _mine(self) -> Iterator[tuple[str, Stateful]]:
        """The parts this rank writes (all of them on a single rank): its RNG states, and
        its turn of the replicated parts (`trainer.ranks.distributed`)."""
        shared = (n for n in self.parts if n != RNG_PART)
        for i, name in enumerate(shared):
            if self.ranks is None or self.ranks.owns(i):
                yield name, self.parts[name]
        if RNG_PART in self.parts:
            yield RNG_PART, self.parts[RNG_PART]

    def _shards(self) -> Shards | None:
        """This rank's sharded state at the save's step: copied on the training thread for a
        background save (training changes the shards in place), read live otherwise."""
        if self.sharded is None:
            return None
        state = self.sharded.snapshot() if self.async_save else self.sharded.state_dict()
        return Shards(state, self.sharded.sizes())

    def _fence(self, _optimizer, _args, _kwargs) -> None:
        snap = self._snapshot
        if snap is not None:
            snap.fence()

    def _prepare(self, _optimizer, _args, _kwargs) -> None:
        """After the optimizers' first step (their state exists now): the host buffers are
        allocated and touched in the background, not by the first save's copy."""
        if self._prepared:
            return
        self._prepared = True
        self._worker.submit(self._prepare_buffers)  # starts the worker, off any save

    def _prepare_buffers(self) -> None:
        on_a_helper_thread()
        self._buffers.prepare(owned_tensors(self._optimizers))

    def _persist_bg(self, step: int, snap: Snapshot, shards: Shards | None, meta: dict,
                    t0: float, call_s: float) -> None:
        """On the worker: the copy at the training thread's priority (a step may wait for
        it at the fence), then the write on a thread of its own that steps back from
        training (a thread's niceness cannot be lowered again, and the worker is kept)."""
        on_a_helper_thread()
        try:
            state = snap.copy(self._buffers)
            stall = call_s + snap.settled_fence_wait()
            writer = threading.Thread(target=self._write_bg, name=f"checkpoint-step-{step}",
                                      args=(step, state, shards, meta, t0, stall))
            writer.start()
            writer.join()
        except BaseException as e:  # surfaced by the next step(), save() or wait()
            self._error = e

    def _write_bg(self, step: int, state: dict, shards: Shards | None, meta: dict, t0: float,
                  stall: float) -> None:
        on_a_helper_thread()
        try:
            _yield_to_training()
            self._persist(step, state, shards, meta, t0, stall)
        except BaseException as e:
            self._error = e

    def _persist(self, step: int, state: dict, shards: Shards | None, meta: dict, t0: float,
                 stall: float | None) -> Manifest | None:
        """Write and commit `state`; `stall`: the training thread's wait for a background
        save (None: this save is synchronous, the training thread waits for all of it)."""
        w0 = time.perf_counter()
        pending = self.repo.begin(step, self.attempt, end=meta.get(END_AGAIN) is True)
        if shards is not None:  # a collective: every rank saves the same step
            self.sharded.write(self.repo, pending, self.ranks, shards.state,
                               background=stall is not None)
            meta[SHARDED_META] = self.sharded.names
            meta.setdefault("part_bytes", {}).update(shards.sizes)
        filename = STATE_FILE if self.ranks is None else rank_file(self.ranks.rank)
        self._write_state(pending, filename, state)
        if self.ranks is not None and not self._gathered(pending, meta):
            return None  # rank 0 commits what every rank wrote
        # Synchronous: the stall up to the manifest (the pointer's move is left out).
        known = stall if stall is not None else time.perf_counter() - t0
        manifest = self.repo.commit(pending, {**meta, "blocking_seconds": round(known, 4)})
        now = time.perf_counter()
        deleted = self.repo.apply_retention(self.keep_last, self.keep_best, self.attempt)
        if deleted:
            log.info("retention removed %s", ", ".join(deleted))
        stats = {"save_seconds": round(now - t0, 4), "write_seconds": round(now - w0, 4),
                 "blocking_seconds": round(stall if stall is not None
                                           else time.perf_counter() - t0, 4)}
        if self.on_commit:
            self.on_commit(manifest, stats)
        return manifest

    def _write_state(self, pending: Pending, filename: str, state: dict) -> None:
        try:
            if self.repo.store.native_files:
                with self.repo.write_path(pending, filename) as path:
                    _save(state, path)
            else:  # S3: serialize straight into the multipart upload
                with self.repo.write_file(pending, filename) as w:
                    _save(state, w)
        except UNPICKLABLE as e:
            if (refused := unsavable_error(state, pending.step, e)) is None:
                raise
            # A checkpoint without a manifest does not exist: what it left is removed.
            delete_checkpoint(self.repo.layout, pending.name, only_partial=True)
            self.repo.store.delete(self.repo.key(pending.name, filename))  # its empty folder
            raise refused from None

    def _gathered(self, pending: Pending, meta: dict[str, Any]) -> bool:
        """Wait until every rank's file of `pending` is durable; on rank 0 (True) add their
        entries and part sizes to the checkpoint it alone commits."""
        mine = (pending.written, meta.get("part_bytes") or {})
        everyone = self.ranks.to_leader(mine, self.ranks.saves_on)
        if everyone is None:
            return False
        for written, sizes in everyone:
            pending.written.update(written)
            meta.get("part_bytes", {}).update(sizes)
        meta[WORLD_SIZE] = self.ranks.world
        return True

    @property
    def in_flight(self) -> bool:
        """A background save is still being copied or written."""
        return self._job is not None and not self._job.done()

    @property
    def unsettled(self) -> bool:
        """A background save was started and its end not yet taken up by `wait` (an error
        of it may still be to raise), however far it got."""
        return self._job is not None

    def raise_if_failed(self) -> None:
        """Raise the error of a background save that has ended (it fails the attempt with
        the error's own class: a store error is a storage failure). Never waits."""
        if self._job is not None and self._job.done():
            self.wait()

    def wait(self) -> None:
        """Block until a background save has finished; re-raise its error here."""
        if self._job is not None:
            self._job.result()
            self._job = None
            self._snapshot = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        try:
            self.wait()
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []

    # -- load ---------------------------------------------------------------------------
    def load(self, manifest: Manifest) -> None:
        """Verify `manifest`'s files, then restore every part from them. A checkpoint of
        another world size restores all but the RNG states, which are re-derived."""
        rank, world = (self.ranks.rank, self.ranks.world) if self.ranks else (0, 1)
        state = load_rank_state(self.repo, manifest, rank, world)
        if RNG_PART in self.parts and RNG_PART not in state:
            rederive_rngs(self.repo.run, manifest.step, rank)
            state[RNG_PART] = self.parts[RNG_PART].state_dict()
        missing = set(self.parts) - set(state)
        if missing:
            raise CheckpointError(
                f"checkpoint {self.repo.uri(manifest.name)} has no state for "
                f"{sorted(missing)}; it was written by a different task or trainer version"
            )
        if self.sharded is not None:  # first: its optimizer init must not follow the RNGs
            self.sharded.read(self.repo, manifest, self.ranks)
        for name, part in self.parts.items():
            try:
                part.load_state_dict(state[name])
            except (RuntimeError, KeyError, ValueError, TypeError) as e:
                raise CheckpointError(
                    f"checkpoint {self.repo.uri(manifest.name)} does not fit part {name!r}: {e}. "
                    "Resume with the config the run was started with, or --resume never."
                ) from e


def _unwrapped(part: Any) -> Any:
    """The part behind the wrappers that name it by `__wrapped__` (`trainer.api.parts.Measured`)."""
    try:
        return inspect.unwrap(part)
    except ValueError:  # an object that answers every attribute: no chain to follow
        return part


def _yield_to_training() -> None:
    """Lower this thread's CPU priority (and so that of the threads it starts to hash and
    fsync): training waits for nothing here, so where cores are short the write gives way
    to it. Linux threads have their own nice value; elsewhere this does nothing."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid)
                                                 + WRITER_NICENESS))
    except (OSError, AttributeError):
        pass


def _save(state: dict[str, Any], dest) -> None:
    # The manifest's SHA-256 already guards every byte; torch's per-record CRC32 would be a
    # second, slower checksum pass over the same bytes.
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(state, dest)
    finally:
        torch.serialization.set_crc32_options(crc)
