"""Where a hand-rolled batch loop continues after a resume: the epoch, the batch, and
whether the epoch's end-of-epoch work is still to do (`CheckpointSession.position`,
`epochs()`, `batches()`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..base.errors import ConfigError
from .checkpointer import RNGState

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class Position:
    """Where a loop of a fixed number of batches per epoch continues after `restore`."""

    epoch: int  # the epoch to continue in (0-based)
    batch: int  # how many of its batches are trained: the index of the next one
    # Every batch of `epoch` is trained but its end-of-epoch work (evaluation, an LR
    # decision) is not done: the checkpoint was committed at its last batch, before it.
    epoch_end_pending: bool


@dataclass
class EpochWalk:
    """What `epochs()` and `batches()` share about the epoch in progress."""

    per_epoch: int
    first: int = 0  # the first batch of the current epoch still to train
    batches_due: bool = False  # an epoch began; batches() has not started on it yet
    last_batch: bool = False  # batches() handed out the epoch's last batch
    # The run's last epoch: its end is committed by close(), after its end-of-epoch work
    # (a last evaluation, an LR or best-score update), as the run's final checkpoint.
    last_epoch: bool = False
    resume_rng: dict[str, Any] | None = None  # the checkpoint's generators, set back by batches()
    # Told when an epoch begins and when its last batch is handed out: the steps that must
    # see the walk (the session's short path does not look at it).
    moved: Callable[[], None] = lambda: None


def position_of(loop, batches_per_epoch: int) -> Position:
    """Where the loop continues, from the session's loop state. A checkpoint at an epoch's
    last batch was committed before that epoch's end-of-epoch work (by `step` inside the
    batch loop): the position is then that epoch, all its batches done,
    `epoch_end_pending`. With `epochs()` the session records which epochs finished and
    needs no such assumption."""
    if not isinstance(batches_per_epoch, int) or batches_per_epoch < 1:
        raise ConfigError(f"batches_per_epoch is {batches_per_epoch!r}; pass the number "
                          "of batches in one epoch (a positive integer)")
    step, done = loop.step, loop.epochs_done
    if done is None:
        epoch, batch = divmod(step, batches_per_epoch)
        if batch == 0 and epoch > 0:
            epoch, batch = epoch - 1, batches_per_epoch
    else:
        epoch, batch = done, step - done * batches_per_epoch
        if not 0 <= batch <= batches_per_epoch:
            raise ConfigError(
                f"the checkpoint holds step {step} with {done} epoch(s) done, which does "
                f"not fit {batches_per_epoch} batches per epoch: the data or the batch "
                "size changed since. Resume with the ones the run started with, or "
                "register a new run")
    return Position(epoch, batch, batch == batches_per_epoch and step > 0)


def walk_epochs(loop, walk: EpochWalk, pos: Position, epochs: int) -> Iterator[int]:
    """The epochs from `pos` on. A resume inside an epoch runs the epoch's prologue (the code
    between this loop and `batches()`, a shuffle say) again from the random generators the
    epoch began with, so that it draws what it drew before; `batches()` then sets the
    checkpoint's generators back and continues with the next batch. A resume right after an
    epoch's last batch gives that epoch again with no batches, so its end-of-epoch work
    runs."""
    for epoch in range(pos.epoch, epochs):
        loop.epochs_done = epoch
        walk.first = pos.batch if epoch == pos.epoch else 0
        walk.last_epoch = epoch == epochs - 1
        if walk.first and loop.epoch_rng is not None:
            walk.resume_rng = RNGState().state_dict()
            RNGState().load_state_dict(loop.epoch_rng)
        else:
            if walk.first:
                log.warning("the checkpoint does not hold the generators epoch %d began "
                            "with (it was not written inside epochs()): its prologue "
                            "draws from the checkpoint's instead", epoch)
            loop.epoch_rng = RNGState().state_dict()
        walk.batches_due = True
        walk.moved()
        yield epoch
    loop.epochs_done = max(epochs, pos.epoch)


def walk_batches(walk: EpochWalk) -> Iterator[int]:
    walk.batches_due = False
    if walk.resume_rng is not None:
        RNGState().load_state_dict(walk.resume_rng)
        walk.resume_rng = None
    for batch in range(walk.first, walk.per_epoch):
        walk.last_batch = batch == walk.per_epoch - 1 and not walk.last_epoch
        if walk.last_batch:
            walk.moved()
        yield batch
    walk.last_batch = False
