"""Plain values a script keeps in variables, checkpointed by name in one line:

    ckpt.keep(globals(), "lr", "best_val_loss", "hidden")   # a script's globals
    ckpt.keep(self, "epochs_run")                           # an object's attributes

Numbers, strings, None, tensors and tuples or lists of them (an LSTM's hidden state) are
read where they live at each commit and set back there on restore, so a script need not
mirror them through a dict (create it, copy back after restore, update before each step).
A function's local variable cannot be set from outside the function: declare it `global`
(or keep it on an object) to keep it.

Inside `epochs()`, a resume in the middle of an epoch runs the epoch's prologue again (a
`hidden = model.init_hidden()` say); `batches()` then sets the kept values back to the
checkpoint's, as it does the generators, so the prologue cannot overwrite them.
"""

from __future__ import annotations

from typing import Any

from ..base.errors import ConfigError

KEPT_PART = "kept"


class Kept:
    """The checkpoint part of the values named with `CheckpointSession.keep`."""

    def __init__(self) -> None:
        self._where: dict[str, Any] = {}  # name -> the dict or object that holds it
        self._restored: dict[str, Any] | None = None

    def add(self, where: Any, names: tuple[str, ...]) -> None:
        if not names:
            raise ConfigError("keep() names no value: pass where they live and their names, "
                              "e.g. ckpt.keep(globals(), \"lr\", \"best_val_loss\")")
        for name in names:
            if not isinstance(name, str) or not name.isidentifier():
                raise ConfigError(f"keep(): {name!r} is not a variable or attribute name")
            if name in self._where and self._where[name] is not where:
                raise ConfigError(f"keep(): {name!r} is kept from two places already; give "
                                  "one of them another name")
            self._where[name] = where

    def state_dict(self) -> dict[str, Any]:
        """The values as they are now; one not defined yet is left out."""
        out = {}
        for name, where in self._where.items():
            if isinstance(where, dict):
                if name in where:
                    out[name] = where[name]
            elif hasattr(where, name):
                out[name] = getattr(where, name)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            where = self._where.get(name)
            if isinstance(where, dict):
                where[name] = value
            elif where is not None:
                setattr(where, name, value)
        self._restored = dict(state)

    def after_prologue(self, resumed_inside: bool) -> None:
        """An epoch's prologue ran: inside the restored epoch, set the checkpoint's values
        back over what it assigned. Once only: later epochs keep their own."""
        if resumed_inside and self._restored is not None:
            self.load_state_dict(self._restored)
        self._restored = None
