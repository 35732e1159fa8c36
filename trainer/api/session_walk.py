"""Where a hand-rolled batch loop continues (`position`, `epochs`, `batches`) and the
plain values a script keeps by name (`keep`).

One concern of the session's (`trainer.api.session`), on the session's own state: a mixin
of `CheckpointSession`, never used on its own.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from ..base.errors import (
    ConfigError,
)
from .data import ResumableLoader
from .epochs import EpochWalk, Position, position_of, walk_batches, walk_epochs
from .kept import Kept

log = logging.getLogger("trainer")


class Walking:
    """The position helpers of a loop without a DataLoader, and kept values."""

    def position(self, batches_per_epoch: int) -> Position:
        """The epoch and batch to continue from after `restore`, with `batches_per_epoch`
        batches per epoch (`trainer.api.epochs.position_of`)."""
        if self._ck is None:
            raise ConfigError("call restore() before position(): the position is the "
                              "restored checkpoint's")
        return position_of(self.loop, batches_per_epoch)

    def epochs(self, epochs: int, batches_per_epoch: int, *, start: int = 0) -> Iterator[int]:
        """The epochs still to train, from the restored one, as `range(start, epochs)`
        numbers them (`start=1`: a loop over `range(1, n + 1)` becomes
        `ckpt.epochs(n + 1, batches_per_epoch, start=1)`); iterate `batches()` in each
        (`trainer.api.epochs.walk_epochs` says how a resume inside an epoch continues)."""
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= epochs:
            raise ConfigError(f"epochs(): start is {start!r}; pass the first epoch's number, "
                              f"from 0 to epochs ({epochs})")
        pos = self.position(batches_per_epoch)
        self._walk = EpochWalk(batches_per_epoch, moved=self._walk_moved)
        self._calm_until = 0
        walk = walk_epochs(self.loop, self._walk, pos, epochs - start)
        return walk if not start else (epoch + start for epoch in walk)

    def _walk_moved(self) -> None:
        """An epoch began or its last batch is out: the next step takes the full path,
        which checks the step against the walk (and commits an epoch's end)."""
        self._calm_until = 0

    def batches(self, items: Iterable[Any] | None = None) -> Iterator[Any]:
        """The batch indices of the current epoch of `epochs()` still to train; or, given
        the epoch's `items` (`enumerate(range(0, n, bptt))`, a list of batches), those
        items from the one the epoch continues with; or, given a `ResumableLoader` part, its
        batches (it continues the restored epoch itself)."""
        if self._walk is None:
            raise ConfigError("batches() goes inside `for epoch in ckpt.epochs(epochs, "
                              "batches_per_epoch)`, which knows where the epoch continues")
        if self._kept is not None:
            self._kept.after_prologue(resumed_inside=self._walk.first > 0)
        indices = self._ending_loaders_epochs(walk_batches(self._walk))
        if items is None:
            return indices
        if isinstance(items, ResumableLoader):
            return self._loader_batches(indices, items)
        # The indices first: zip asks them for each next item, so they see the epoch's end.
        return (item for _, item in zip(indices, itertools.islice(items, self._walk.first, None),
                                        strict=False))

    def _ending_loaders_epochs(self, indices: Iterator[int]) -> Iterator[int]:
        """The epoch's batch indices; at their end, the epoch of each `ResumableLoader` part
        that handed out its last batch is over (`zip(ckpt.batches(), loader)` never asks the
        loader for its end, which would otherwise take the next `iter()` for a peek's)."""
        yield from indices
        for loader in self._loaders:
            loader.epoch_taken()

    def _loader_batches(self, indices: Iterator[int], loader: ResumableLoader) -> Iterator[Any]:
        """The batches of a `ResumableLoader` part, which continues the restored epoch by
        itself, checked to stand where the epoch continues."""
        if loader not in self._loaders:
            raise ConfigError("batches(loader): pass the ResumableLoader to restore() as a "
                              "part, so that it resumes where the epoch continues")
        walk = self._walk
        batches: Iterator[Any] = iter(())  # none left: the epoch's end-of-epoch work is due
        if walk.first < walk.per_epoch:
            batches = iter(loader)
            if loader.position != walk.first or len(loader) != walk.per_epoch:
                raise ConfigError(
                    f"batches(loader): the loader stands at batch {loader.position} of "
                    f"{len(loader)}, the epoch continues at {walk.first} of {walk.per_epoch}: "
                    "pass len(loader) as epochs()'s batches_per_epoch, and take the epoch's "
                    "batches from batches(loader) alone")
        for _, batch in zip(indices, batches, strict=False):
            yield batch

    def keep(self, where: Any, *names: str) -> None:
        """Checkpoint the plain values `names` where they live, a dict (a script's
        `globals()`) or an object's attributes; before `restore`, which sets them back
        (`trainer.api.kept`)."""
        if self._ck is not None:
            raise ConfigError("keep() goes before restore(), which sets the kept values back")
        if self._kept is None:
            self._kept = Kept()
        self._kept.add(where, names)
