"""Which generator states an attempt started from, to name a resume that drew other data.

A script that seeds nothing starts Python's, NumPy's and torch's generators from fresh
entropy in every process, so whatever it draws before `restore()` (weights, a synthetic
data set, a train/validation split) differs between the first attempt and a resumed one,
and the resumed run silently continues on other data. The restore itself cannot undo
that: it sets the generators back only for what is drawn after it.

The session takes `identity()` when it is created (after its own `seed=`, before
`restore`), records it with every checkpoint next to the first attempt's, and on a resume
`differing()` names the generators whose states differ from the first attempt's and that
the script drew from before `restore` (`drawn`): a generator nobody drew from gave nothing
away, however it was seeded. Torch's state then differs from the one its seed gives;
Python's and NumPy's Mersenne Twisters stand at the end of their key block after any
seeding (entropy or a number) until the first draw.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

ADVICE = ("seed them before building data and model, or pass seed= to a CheckpointSession "
          "created before them")
# Where a freshly seeded Mersenne Twister stands (Python's and NumPy's), before any draw:
# its key block's end (NumPy seeded from entropy: one before it).
_FRESH_POS = (623, 624)


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()[:16]


def identity() -> dict[str, Any]:
    """Short digests of the generators' states now."""
    kind, keys, pos, *_ = np.random.get_state()
    return {
        "python": _digest(repr(random.getstate()).encode()),
        "numpy": _digest(kind.encode(), keys.tobytes(), str(pos).encode()),
        "torch": _digest(torch.get_rng_state().numpy().tobytes()),
    }


def torch_drawn() -> bool:
    """Was torch's default generator drawn from since it was seeded?"""
    fresh = torch.Generator().manual_seed(torch.initial_seed()).get_state()
    return not torch.equal(torch.get_rng_state(), fresh)


def drawn() -> set[str]:
    """The generators drawn from since they were seeded. Asked just before the restore sets
    them: a generator nobody drew from gave nothing away."""
    names = {"torch"} if torch_drawn() else set()
    if random.getstate()[1][-1] not in _FRESH_POS:
        names.add("python")
    if np.random.get_state()[2] not in _FRESH_POS:
        names.add("numpy")
    return names


def differing(first: dict[str, Any], now: dict[str, Any], drawn: set[str]) -> list[str]:
    """The generators whose state at this attempt's start is not the first attempt's, and
    that this attempt `drawn` from before its restore."""
    return [g for g in ("torch", "numpy", "python")
            if g in first and g in now and first[g] != now[g] and g in drawn]


def warning_for(attempt: int, first_attempt: int, names: list[str]) -> str:
    """The warning naming this attempt, the generators that differ, and what to do."""
    which = ", ".join(names)
    return (f"attempt {attempt} began with other random generator states ({which}) than "
            f"attempt {first_attempt}: whatever the script drew from them before restore() "
            "(weights, data, a split) differs from the first attempt's, and the run "
            f"continues on it; {ADVICE}")
