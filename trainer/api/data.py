"""A DataLoader that resumes at the exact next batch, with worker processes too.

The order of each epoch is a pure function of (seed, epoch): a seeded permutation, or the
dataset's own order when `shuffle=False` (language models read text in order). The state is
two integers, the epoch and the number of batches the *training loop* has taken from it;
batches that worker processes prefetched but the loop never saw are not counted, so a
resume hands out the very next batch the interrupted run would have trained on.

Why not torchdata's StatefulDataLoader: it resumes exactly too, but it draws another order
than torch's DataLoader for the same seed, its state is a private layout of its own, and a
loop that breaks right after an epoch's last batch resumes into an empty epoch. Two
integers and a fresh iterator at the saved position do the same job with no dependency.

Worker processes get seeds from a generator seeded by (seed, epoch), never from the global
torch RNG, so building an iterator draws nothing a resumed run would lack. Random
augmentation inside workers is not part of any checkpoint: derive it from the sample index
and epoch if it must be reproducible across a resume.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate


class _Positions(torch.utils.data.Sampler[list[int]]):
    """The index batches of one epoch, from batch `start` on: of each global batch, the
    `rank`-th of `world` equal slices."""

    def __init__(self, order: torch.Tensor, batch_size: int, start: int, batches: int,
                 rank: int = 0, world: int = 1):
        self.order, self.batch_size, self.start, self.batches = order, batch_size, start, batches
        self.rank, self.per_rank = rank, batch_size // world

    def __iter__(self) -> Iterator[list[int]]:
        for b in range(self.start, self.batches):
            first = b * self.batch_size + self.rank * self.per_rank
            yield self.order[first:first + self.per_rank].tolist()

    def __len__(self) -> int:
        return self.batches - self.start


class ResumableLoader:
    """Batches of a map-style dataset (`len` and `[i]`) across epochs, resumable exactly.

    Like a DataLoader: `len(loader)` is the batches of one epoch, and each `iter(loader)`
    is one epoch. The first after a restore continues the restored epoch at its next
    batch; once an epoch was iterated to its end, the next `iter()` begins the next epoch;
    an `iter()` while an earlier iterator of the epoch stopped partway (a peek such as
    `next(iter(loader))`, or a `break`) begins that epoch again where this process began
    it, so a peek costs no batch. Only the newest iterator counts batches: an abandoned one
    ends. Save it as a checkpoint part (it has `state_dict`/`load_state_dict`). Incomplete
    final batches are dropped, so every epoch has `batches_per_epoch` batches of
    `batch_size`.

    With several ranks `batch_size` is the global batch: rank `rank` of `world` takes its
    slice of each one. The state counts global batches, so it is the same on every rank
    and a resume at another world size continues at the same sample.
    """

    def __init__(self, dataset: Any, batch_size: int, *, seed: int = 0, shuffle: bool = True,
                 num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
                 pin_memory: bool = False, rank: int = 0, world: int = 1):
        if not isinstance(dataset, Sized):
            raise TypeError("the dataset must have a length (a map-style dataset)")
        if len(dataset) < batch_size:
            raise ValueError(f"dataset of {len(dataset)} samples is smaller than one batch "
                             f"({batch_size})")
        if batch_size % world:
            raise ValueError(f"the batch of {batch_size} samples does not split evenly over "
                             f"{world} ranks; make it a multiple of {world}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.rank, self.world = rank, world
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.collate_fn = collate_fn or default_collate
        self.pin_memory = pin_memory
        self.epoch = 0
        self.position = 0  # batches of this epoch the loop has taken
        # Where this process began the current epoch (0, or the restored position), whether
        # an iterator of it began already, whether one ran it to its end, and which iterator
        # is the live one.
        self._epoch_start = 0
        self._begun = False
        self._ran_out = False
        self._live = 0

    @property
    def n(self) -> int:
        return len(self.dataset)

    @property
    def batches_per_epoch(self) -> int:
        return self.n // self.batch_size

    @property
    def epoch_finished(self) -> bool:
        return self.position >= self.batches_per_epoch

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.n)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n, generator=g)

    def _loader(self) -> DataLoader:
        positions = _Positions(self._order(), self.batch_size, self.position,
                               self.batches_per_epoch, self.rank, self.world)
        return DataLoader(
            self.dataset, batch_sampler=positions, num_workers=self.num_workers,
            collate_fn=self.collate_fn, pin_memory=self.pin_memory,
            generator=torch.Generator().manual_seed(self.seed * 7_919 + self.epoch),
            persistent_workers=False)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        if self._begun and not self._ran_out:
            # An earlier iterator stopped partway: a peek at the first batch, which may be
            # the epoch's last one where a resume restored the loader one batch before it.
            self.position = self._epoch_start
        if self.epoch_finished:
            self.epoch, self.position, self._epoch_start = self.epoch + 1, 0, 0
        self._begun, self._ran_out = True, False
        self._live += 1
        return self._epoch(self._live)

    def _epoch(self, me: int) -> Iterator[Any]:
        for batch in self._loader():
            if me != self._live:
                return  # a newer iterator took over this epoch
            self.position += 1  # counted when the loop takes it, not when a worker made it
            yield batch
        if me == self._live:
            self._ran_out = True

    def epoch_taken(self) -> None:
        """The loop took the epoch's last batch and will not ask for the end: `zip` stops at
        its shorter input without asking the longer one whether it is done. The epoch is
        over, so the next `iter()` begins the next one, not the same one again as after a
        peek. The session calls this at the end of each epoch of `batches()`."""
        if self._begun and self.epoch_finished:
            self._ran_out = True

    def batches(self) -> Iterator[Any]:
        """An endless stream of batches across epochs (for step-based loops)."""
        while True:
            yield from self

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "n": self.n, "batch_size": self.batch_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = (state["n"], state["batch_size"], state.get("shuffle", True))
        if saved != (self.n, self.batch_size, self.shuffle):
            raise ValueError(
                f"the data loader was saved for {saved[0]} samples in batches of {saved[1]} "
                f"(shuffle={saved[2]}), now {self.n} in batches of {self.batch_size} "
                f"(shuffle={self.shuffle})")
        self.epoch, self.position, self.seed = state["epoch"], state["position"], state["seed"]
        if self.epoch_finished:
            # Saved right after an epoch's last batch: the loader stands at the next epoch's
            # start, so `range(loader.epoch, epochs)` resumes at the right epoch.
            self.epoch, self.position = self.epoch + 1, 0
        self._epoch_start, self._begun, self._ran_out = self.position, False, False
