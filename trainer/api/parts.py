"""The parts of a checkpoint besides the user's: the session's own loop state, a plain dict
as a part, and what a part's state weighs.

A part is anything with `state_dict()`/`load_state_dict()`, or a dict of plain values
(restored in place); `loop` and `rng` are the session's own. torchdata's StatefulDataLoader
is restored through `trainer.api.stateful_loader`.
"""

from __future__ import annotations

import math
import pickle
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..base.errors import ConfigError
from .stateful_loader import StatefulLoaderPart, is_stateful_loader

OPTIMIZER_SIZE_WARNING = 10  # an optimizer state this many times the model's is worth a warning

RESERVED_PARTS = ("loop", "rng")
# What pickling raises for a value it cannot pickle (a lambda: AttributeError).
UNPICKLABLE = (pickle.PicklingError, TypeError, AttributeError)
# What the best score measures: an evaluation metric (`best_metric`), or, while the metrics
# never name it, the training loss of the committed checkpoints.
BEST_OF_METRIC, BEST_OF_LOSS = "metric", "loss"


@dataclass
class LoopState:
    """The session's own counters and history: part of every checkpoint."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    best_score: float = math.inf
    metrics: dict[str, float] = field(default_factory=dict)
    best_of: str | None = None  # BEST_OF_METRIC or BEST_OF_LOSS, once there is a best
    # With `epochs()`: epochs whose end-of-epoch work is done, and the generators' states
    # when the current epoch began (a resume inside it replays its prologue from them).
    epochs_done: int | None = None
    epoch_rng: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "losses": torch.tensor(self.losses, dtype=torch.float64),
                "best_score": self.best_score, "metrics": dict(self.metrics),
                "best_of": self.best_of, "epochs_done": self.epochs_done,
                "epoch_rng": self.epoch_rng}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.step = int(s["step"])
        self.losses = s["losses"].tolist()
        self.best_score = float(s["best_score"])
        self.metrics = dict(s["metrics"])
        # Checkpoints written before these were recorded: a finite best came from metrics.
        self.best_of = s.get("best_of", BEST_OF_METRIC if math.isfinite(self.best_score) else None)
        self.epochs_done = s.get("epochs_done")
        self.epoch_rng = s.get("epoch_rng")

    @property
    def best(self) -> float | None:
        """The best score so far, None before the first (what manifests record: JSON has
        no infinity)."""
        return self.best_score if math.isfinite(self.best_score) else None


class DictPart:
    """A user's dict of plain values (numbers, strings, tensors, lists), restored in place."""

    def __init__(self, values: dict[str, Any]):
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.clear()
        self.values.update(state)


def as_part(name: str, obj: Any) -> Any:
    if name in RESERVED_PARTS:
        raise ConfigError(f"checkpoint part name {name!r} is reserved for the session's own "
                          f"state ({', '.join(RESERVED_PARTS)}); rename your part")
    if isinstance(obj, dict):
        return DictPart(obj)
    if is_stateful_loader(obj):
        return StatefulLoaderPart(obj)
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return obj
    raise ConfigError(f"checkpoint part {name!r} is a {type(obj).__name__} without "
                      "state_dict()/load_state_dict(); pass an object that has both, or a dict "
                      "of plain values")


def seed_all(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators: the session saves all three, so a
    script that seeds only one would still write different bytes on every fresh start."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def as_number(value: float | torch.Tensor, what: str) -> float:
    """A loss or metric as a float; a tensor is detached first (float() of a tensor that
    requires grad warns on every call)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(f"{what} is a tensor of shape {tuple(value.shape)}; pass one "
                              "number (its mean, say)")
        value = value.detach()
    return float(value)


def kind_of(part: Any) -> str | None:
    if isinstance(part, torch.nn.Module):
        return "model"
    if isinstance(part, torch.optim.Optimizer):
        return "optimizer"
    return None


def tensor_bytes(state: Any) -> int:
    """Bytes of tensor data in a state dict, each storage once (what torch.save writes;
    plain values add comparatively little)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
                key, size = (storage.data_ptr(), storage.nbytes()), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # sparse and other layouts
                key, size = (id(obj), 0), obj.numel() * obj.element_size()
            if key not in seen:
                seen.add(key)
                total += size
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple):
            stack.extend(obj)
    return total


def unsavable(state: dict[str, Any]) -> str | None:
    """Where in a checkpoint's state (part, then keys) the first value sits that cannot be
    pickled, and its type; None if each one can. Asked only after a save failed, so its
    cost (a pickle of each value that is not a tensor) never touches a save that works."""
    stack: list[tuple[str, Any]] = [(f"part {name!r}", value)
                                    for name, value in reversed(list(state.items()))]
    while stack:
        where, obj = stack.pop()
        if isinstance(obj, torch.Tensor | int | float | str | bool | None):
            continue
        if isinstance(obj, dict):
            stack.extend((f"{where}, key {k!r}", v) for k, v in reversed(list(obj.items())))
        elif isinstance(obj, list | tuple):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(obj))))
        else:
            try:
                pickle.dumps(obj)
            except Exception:  # whatever pickling raises names this value
                return f"{where} holds a {type(obj).__name__}"
    return None


def unsavable_error(state: dict[str, Any], step: int, error: Exception) -> ConfigError | None:
    """The error naming the value a save at `step` failed on (`error`), or None when no value
    of `state` is to blame."""
    where = unsavable(state)
    if where is None:
        return None
    return ConfigError(
        f"the checkpoint of step {step} cannot be saved: {where}, which cannot be pickled "
        f"({error}). Keep numbers, strings, tensors and lists or dicts of them in a "
        "checkpoint part (a file handle or a lock belongs outside it); nothing was "
        "committed for this step")


def human_bytes(n: int) -> str:
    for unit in ("bytes", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class Measured:
    """A part whose state, as the checkpointer takes it, is measured on the way.

    `__wrapped__` (the convention `inspect.unwrap` follows) names the part itself: the
    checkpointer finds the optimizers behind their wrappers by it, for their fence and host
    buffers (`trainer.api.snapshot`)."""

    def __init__(self, part: Any, name: str, measured):
        self.part, self.name, self.measured = part, name, measured
        self.__wrapped__ = part

    def state_dict(self) -> Any:
        state = self.part.state_dict()
        self.measured(self.name, tensor_bytes(state))
        return state

    def load_state_dict(self, state: Any) -> Any:
        return self.part.load_state_dict(state)


def optimizer_warning(part_kinds: dict[str, str], sizes: dict[str, int]) -> str | None:
    """The warning for an optimizer part many times the size of the model (a commit's sizes
    by part), or None: every checkpoint carries that state, so it sets the save's cost."""
    models = [n for n, kind in part_kinds.items() if kind == "model"]
    model_bytes = sum(sizes.get(n, 0) for n in models)
    for name, kind in part_kinds.items():
        size = sizes.get(name, 0)
        if kind == "optimizer" and model_bytes and size > OPTIMIZER_SIZE_WARNING * model_bytes:
            return (f"checkpoint part {name!r} is {size / model_bytes:.0f}x the model "
                    f"({human_bytes(size)} against {human_bytes(model_bytes)} in "
                    f"{', '.join(models)}), and every checkpoint carries it: that is the "
                    "optimizer's own state (LBFGS keeps 2 x history_size copies of the "
                    "parameters). A smaller history or an optimizer with less state makes "
                    "checkpoints smaller and faster.")
    return None
