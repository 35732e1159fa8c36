"""Snapshots of a checkpoint's state that the training thread does not wait for.

`take` runs on the training thread. It walks the parts' state dicts and sorts every tensor:

* the large tensors an optimizer part owns (its parameters and its state: AdamW's
  moments, ...) change only when that optimizer steps again. They are left to a copy
  worker (`Snapshot.copy`, on the save's background thread), which copies them into host
  buffers allocated once and reused by every later save (pinned when CUDA is present, so a
  device-to-host copy runs asynchronously on a side stream). Each optimizer part carries a
  step pre-hook that waits for that copy (`Snapshot.fence`): forward and backward of the
  next step overlap the copy, the optimizer's write does not.
* everything else is copied there and then: module buffers (BatchNorm's running
  statistics change in the next forward), tensors the optimizers do not own, small tensors
  (not worth a hand-off), and every non-tensor value (containers are rebuilt, so later
  changes to a list or dict in a part do not reach the snapshot).

A tensor view that appears twice (tied weights) is copied once and stays shared in the file,
as `torch.save` of the live state would have it.

What the fence cannot see: a parameter an optimizer part owns that something other than
that optimizer changes in place between a save and the optimizer's next step (in forward,
say). Such a loop keeps `async_save` off (the default).
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

# Below this many bytes a tensor is copied on the training thread: a hand-off costs more.
SMALL_TENSOR_BYTES = 1 << 16


def _storage_key(t: torch.Tensor) -> tuple:
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
        return ("object", id(t))


def _view_key(t: torch.Tensor) -> tuple:
    try:
        return (*_storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
    except (RuntimeError, NotImplementedError):
        return ("object", id(t))


def owned_tensors(optimizers: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """The tensors only an optimizer step writes: its parameters and its state tensors."""
    out = []
    for opt in optimizers:
        for group in opt.param_groups:
            out.extend(p.detach() for p in group["params"])
        for state in opt.state.values():
            out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def owned_storages(optimizers: list[torch.optim.Optimizer]) -> set[tuple]:
    return {_storage_key(t) for t in owned_tensors(optimizers)}


class HostBuffers:
    """Host tensors a snapshot is copied into, one per tensor view: allocated once, ahead
    of the first save (`prepare`, after the optimizers' first step made their state) or at
    the latest by it, and reused by every later save while the view's shape and dtype stay
    the same. One save uses them at a time."""

    def __init__(self) -> None:
        self.pin = torch.cuda.is_available()
        self._slots: dict[tuple, torch.Tensor] = {}
        self._lock = threading.Lock()
        self.allocations = 0  # buffers allocated so far (a steady run stops counting)

    def get(self, like: torch.Tensor) -> torch.Tensor:
        """The buffer for the view `like` (a save's copy writes it)."""
        return self._slot(like, touch=False)

    def prepare(self, tensors: list[torch.Tensor]) -> None:
        """Allocate the buffers of the large ones among `tensors` and touch every page, so
        that a save's copy meets neither allocation nor page faults (pinned buffers are
        touched by pinning)."""
        for t in tensors:
            if t.numel() * t.element_size() >= SMALL_TENSOR_BYTES:
                self._slot(t, touch=not self.pin)

    def retain(self, used: set[tuple]) -> None:
        """Free the buffers of views no longer saved (the optimizers' tensors were replaced)."""
        with self._lock:
            for key in set(self._slots) - used:
                del self._slots[key]

    def _slot(self, like: torch.Tensor, touch: bool) -> torch.Tensor:
        key = _view_key(like)
        with self._lock:  # a save never meets a buffer that is still being touched
            buf = self._slots.get(key)
            if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
                buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=self.pin)
                if touch:
                    buf.zero_()
                self._slots[key] = buf
                self.allocations += 1
            return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._slots.values())


@dataclass
class _Deferred:
    """A place in the snapshot tree whose tensor the copy worker fills in."""

    index: int


@dataclass
class Snapshot:
    """The state at one step: a tree whose deferred tensors `copy` fills in."""

    tree: Any
    sources: list[torch.Tensor] = field(default_factory=list)
    copied: threading.Event = field(default_factory=threading.Event)
    fence_wait_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _waiting: bool = False
    _accounted: threading.Event = field(default_factory=threading.Event)
    _ready: dict = field(default_factory=dict)  # per CUDA device: the step that made the sources

    def copy(self, buffers: HostBuffers) -> Any:
        """On the worker: copy the deferred tensors into `buffers`; the finished tree."""
        try:
            streams: dict[torch.device, torch.cuda.Stream] = {}
            done = [self._copy_one(src, buffers, streams) for src in self.sources]
            for stream in streams.values():
                stream.synchronize()  # only the copies: training's own stream runs on
        finally:
            self.copied.set()  # a failed copy must not hang the training thread's fence
        buffers.retain({_view_key(src) for src in self.sources})
        self.sources = []
        return _fill(self.tree, done)

    def _copy_one(self, src: torch.Tensor, buffers: HostBuffers,
                  streams: dict) -> torch.Tensor:
        dst = buffers.get(src)
        if not src.is_cuda:
            return dst.copy_(src)
        stream = streams.get(src.device)
        if stream is None:
            stream = streams[src.device] = torch.cuda.Stream(device=src.device)
            stream.wait_event(self._ready[src.device])  # the step that wrote the sources
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(stream)
        return dst

    def fence(self) -> None:
        """On the training thread, before an optimizer writes its tensors: wait for the copy."""
        if self.copied.is_set():
            return
        with self._lock:
            if self.copied.is_set():
                return
            self._waiting = True
        t0 = time.perf_counter()
        self.copied.wait()
        with self._lock:
            self.fence_wait_s += time.perf_counter() - t0
            self._waiting = False
        self._accounted.set()

    def settled_fence_wait(self) -> float:
        """On the worker, after `copy`: the training thread's whole wait for this copy (a
        fence woken by the copy is let finish counting first)."""
        with self._lock:
            waiting = self._waiting
        if waiting:
            self._accounted.wait()
        return self.fence_wait_s


def take(state: Any, owned: set[tuple]) -> Snapshot:
    """On the training thread: `state` with every tensor but the owned, large ones copied."""
    snap = Snapshot(tree=None)
    seen: dict[tuple, Any] = {}

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            key = _view_key(obj)
            if key not in seen:
                seen[key] = _one_tensor(obj.detach(), owned, snap)
            return seen[key]
        if isinstance(obj, dict):
            items = ((k, walk(v)) for k, v in obj.items())
            return dict(items) if type(obj) is dict else type(obj)(items)
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, tuple):
            values = [walk(v) for v in obj]
            return type(obj)(*values) if hasattr(obj, "_fields") else tuple(values)
        return copy.deepcopy(obj)

    snap.tree = walk(state)
    if any(src.is_cuda for src in snap.sources):
        snap._ready = {d: _record_event(d) for d in {s.device for s in snap.sources if s.is_cuda}}
    return snap


def _one_tensor(t: torch.Tensor, owned: set[tuple], snap: Snapshot) -> Any:
    nbytes = t.numel() * t.element_size()
    if nbytes >= SMALL_TENSOR_BYTES and _storage_key(t) in owned:
        snap.sources.append(t)
        return _Deferred(len(snap.sources) - 1)
    return t.to("cpu", copy=True)


def _record_event(device: torch.device) -> torch.cuda.Event:
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


def _fill(obj: Any, done: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Deferred):
        return done[obj.index]
    if isinstance(obj, dict):
        items = ((k, _fill(v, done)) for k, v in obj.items())
        return dict(items) if type(obj) is dict else type(obj)(items)
    if isinstance(obj, list):
        return [_fill(v, done) for v in obj]
    if isinstance(obj, tuple):
        values = [_fill(v, done) for v in obj]
        return type(obj)(*values) if hasattr(obj, "_fields") else tuple(values)
    return obj
