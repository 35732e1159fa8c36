"""Loss tensors read together, late: what lets `step(loss=tensor)` take the short path.

Reading a tensor's value (`.item()`, `float()`) waits for the device to finish every kernel
queued before it, so a loss read on every step would put a host sync in every step of a GPU
loop. The session instead keeps each step's loss tensor as it is (no copy, no detach) and
reads the kept ones together when a full step runs anyway: at least every `SETTLE_STEPS`
steps and every `heartbeat_seconds` (when progress is reported), and before every commit.
One read of a batch is one sync (on the CPU, no sync at all).

What the session promised of a loss still holds, later by at most that much: a NaN or
infinite loss is divergence (exit 4) naming the step it came from, before any checkpoint
that would hold the diverged state is committed, and every loss enters the loss history in
its step's order. A kept tensor must not be changed in place after it was passed (an
accumulator reused across steps, `total.zero_()`): that is refused when the losses are read,
since the value of its step is gone.
"""

from __future__ import annotations

import math

import torch

from ..base.errors import ConfigError, DivergedError

# The most steps a loss tensor waits to be read: the latency of divergence detection in
# steps, and how many small tensors are held meanwhile.
SETTLE_STEPS = 100


class KeptLosses:
    """The losses of the steps since the last read, as passed: (step, value, version)."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[tuple[int, float | torch.Tensor, int]] = []

    def settle(self, history: list[float], last_good: int | None) -> None:
        """Read the kept losses into `history`, in their steps' order. A non-finite one
        raises `DivergedError` (the ones before it are in the history); a tensor of more
        than one number, or changed in place since its step, raises `ConfigError`."""
        items, self.items = self.items, []
        for step, value in zip((s for s, _, _ in items), _values(items), strict=True):
            if not math.isfinite(value):
                raise DivergedError(
                    f"loss is {value} at step {step}; the last good checkpoint is step "
                    f"{last_good}. Lower the learning rate or check the data, then start a "
                    "new run.")
            history.append(value)


def _values(items: list[tuple[int, float | torch.Tensor, int]]) -> list[float]:
    """The values of `items`: a tensor on the CPU by itself (nothing to wait for), those on
    a device stacked and copied to the host in one transfer per device."""
    out: list[float | None] = []
    on_device: dict[torch.device, list[int]] = {}
    for i, (step, value, version) in enumerate(items):
        if type(value) is not torch.Tensor:
            out.append(value)
            continue
        if value._version != version:
            raise ConfigError(
                f"the loss tensor passed at step {step} was changed in place after the step "
                "(the session reads losses a few steps later); pass a tensor the loop does "
                "not modify afterwards, e.g. loss.detach().clone(), or a float")
        if value.numel() != 1:
            raise ConfigError(f"loss is a tensor of shape {tuple(value.shape)} at step {step}; "
                              "pass one number (its mean, say)")
        if value.is_cpu:
            out.append(value.item())
        else:
            out.append(None)
            on_device.setdefault(value.device, []).append(i)
    for where in on_device.values():
        with torch.no_grad():
            read = torch.stack([items[i][1].reshape(()) for i in where]).tolist()
        for i, v in zip(where, read, strict=True):
            out[i] = float(v)
    return out
