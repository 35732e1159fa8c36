"""Which generator states an attempt started from, to name a resume that drew other data.

A script that seeds nothing starts Python's, NumPy's and torch's generators from fresh
entropy in every process, so whatever it draws before `restore()` (weights, a synthetic
data set, a train/validation split) differs between the first attempt and a resumed one,
and the resumed run silently continues on other data. The restore itself cannot undo
that: it sets the generators back only for what is drawn after it.

The session takes `identity()` when it is created (after its own `seed=`, before
`restore`), records it with every checkpoint next to the first attempt's, and on a resume
`differing()` names the generators whose states differ from the first attempt's. Torch's
difference matters only if the script drew from it before `restore` (`torch_drawn`: its
state is then no longer the one its seed gives); Python's and NumPy's cannot be judged
that way, so their difference is said more quietly (they are often left unseeded and unused).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

ADVICE = "seed torch before building data and model, or pass seed= before them"
# The generators whose difference is a warning; the others' is an info line.
LOUD = ("torch",)


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
    """Was torch's default generator drawn from since it was seeded? Asked just before the
    restore sets it: a generator nobody drew from gave nothing away."""
    fresh = torch.Generator().manual_seed(torch.initial_seed()).get_state()
    return not torch.equal(torch.get_rng_state(), fresh)


def differing(first: dict[str, Any], now: dict[str, Any], drawn: bool = True) -> list[str]:
    """The generators whose state at this attempt's start is not the first attempt's;
    torch only if this attempt `drawn` from it before its restore."""
    names = [g for g in ("torch", "numpy", "python")
             if g in first and g in now and first[g] != now[g]]
    if "torch" in names and not drawn:
        names.remove("torch")
    return names


def warning_for(attempt: int, first_attempt: int, names: list[str]) -> tuple[bool, str]:
    """(loud, message) naming this attempt and the generators that differ."""
    loud = any(n in LOUD for n in names)
    which = ", ".join(names)
    if loud:
        return True, (f"attempt {attempt} began with other random generator states ({which}) "
                      f"than attempt {first_attempt}: whatever the script drew before "
                      "restore() (weights, data, a split) differs from the first attempt's, "
                      f"and the run continues on it; {ADVICE}")
    return False, (f"attempt {attempt} began with other {which} generator states than attempt "
                   f"{first_attempt} (unseeded); if the script draws from them before "
                   "restore(), seed them too")
