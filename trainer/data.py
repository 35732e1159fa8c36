"""A shuffling batch sampler whose position inside the epoch is part of the checkpoint."""

from __future__ import annotations

from typing import Any

import torch


class ResumableSampler:
    """Yields index batches; each epoch's order is a function of (seed, epoch) alone.

    Saving (epoch, position) is therefore enough to continue with the very next batch.
    """

    def __init__(self, n: int, batch_size: int, seed: int):
        if n < batch_size:
            raise ValueError(f"dataset of {n} samples is smaller than one batch ({batch_size})")
        self.n = n
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self.position = 0  # batches of this epoch already handed out
        self._order: torch.Tensor | None = None

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch_size

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            self._order = torch.randperm(self.n, generator=g)
        return self._order

    def next_batch(self) -> list[int]:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
            self._order = None
        start = self.position * self.batch_size
        idx = self._epoch_order()[start:start + self.batch_size].tolist()
        self.position += 1
        return idx

    @property
    def epoch_finished(self) -> bool:
        return self.position >= self.batches_per_epoch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n": self.n, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state["n"], state["batch_size"]) != (self.n, self.batch_size):
            raise ValueError(
                f"sampler was saved for {state['n']} samples in batches of {state['batch_size']}, "
                f"now {self.n} in batches of {self.batch_size}"
            )
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
        self._order = None
