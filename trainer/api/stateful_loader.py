"""torchdata's `StatefulDataLoader` as a checkpoint part that resumes bit for bit.

Its own `state_dict` resumes the data exactly, worker processes included, but building the
resumed iterator draws from torch's global generator (the workers' base seed, and the
sampler's seed before the saved sampler state replaces it). The interrupted run drew those
at the start of the epoch, before its checkpoint; a resumed run draws them again after its
generators were restored, so every later draw (dropout, augmentation, the next epoch's
order) would differ. Restoring the part therefore builds the resumed iterator at once, with
the global generator put back afterwards; the loader's next `iter()` returns that iterator
(torchdata keeps the one its `state_dict()` built for the next `iter()`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

MODULE = "torchdata.stateful_dataloader"


def is_stateful_loader(obj: Any) -> bool:
    """Whether `obj` is a torchdata StatefulDataLoader (without importing torchdata: an
    object of it exists only where it was imported)."""
    module = sys.modules.get(MODULE)
    return module is not None and isinstance(obj, module.StatefulDataLoader)


class StatefulLoaderPart:
    """A StatefulDataLoader as a part: its own state, restored without a draw."""

    def __init__(self, loader: Any):
        self.loader = loader
        self.__wrapped__ = loader

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        if not state:
            return
        generator = torch.get_rng_state()
        try:
            self.loader.state_dict()  # builds the resumed iterator, kept for the next iter()
        finally:
            torch.set_rng_state(generator)
