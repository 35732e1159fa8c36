"""The typed launch form: Dagster config classes generated from the trainer's pydantic models.

`trainer.config.TrainConfig` is the one schema of a training config. This module walks its
`model_fields` (and those of its sections) and builds matching `dg.Config` classes with
`pydantic.create_model`, so the launchpad shows every key with the trainer's description,
range and default, and Dagster's own config check refuses an unknown key (`max_stepz`) or a
value of the wrong type before a run is even created. Nothing here spells a field out.

What Dagster config cannot say is translated, never dropped:

* `Literal[...] | None` becomes an optional enum (Dagster has enums, but no optional
  literal), so a value outside the literal is still refused in the form.
* A union of scalar kinds (`checkpoint.every_seconds`: seconds, `auto` or null) takes any
  value in the form; its help says which, and registration checks it with the trainer's
  message.
* `dict[str, Any]` (`task_args`) is a map from strings to anything: the arguments belong to
  the task, which checks them itself.
* Ranges and cross-field rules (`lr > 0`, two betas in [0, 1), a heartbeat of at most 60 s,
  task or command) cannot be expressed in a Dagster schema. The form shows them in each
  key's help; the trainer's model checks them when the run is registered, with the
  trainer's one-line message naming the key. The form copies no validator on purpose: two
  places checking values would drift, and a validation error raised while Dagster builds
  the config object would not be classified as bad input.

Two keys differ from the trainer's defaults, because the launch decides them: `run` is the
partition key and `experiment` defaults to the launch's `experiment` (else `default`). Their
form default is "not given", so a form filled with defaults never contradicts the launch.
"""

from __future__ import annotations

import enum
import re
import types
from functools import cache
from typing import Any, Literal, Union, get_args, get_origin

import dagster as dg
from pydantic import BaseModel, Field, create_model
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from trainer.config import TrainConfig

# Keys the launch decides (see the module docstring): their form default is "not given".
LAUNCH_DECIDES = {
    "run": "leave it out: it is always the partition key (if given, it must equal it)",
    "experiment": "default: the launch's experiment, else 'default'",
}

__all__ = ["LAUNCH_DECIDES", "TrainingForm", "form_class", "training_from_form"]


def _is_optional(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp)


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _range_words(info: FieldInfo) -> str:
    """The range a key's value must lie in (Dagster config has no ranges; the help shows it)."""
    return ", ".join(f"{sym} {getattr(m, attr)}" for m in info.metadata
                     for attr, sym in _BOUNDS if hasattr(m, attr))


def _form_type(tp: Any, path: str) -> Any:
    """The annotation `tp` (of the trainer key at `path`) as a type Dagster config can express."""
    origin, args = get_origin(tp), get_args(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return form_class(tp)
    if origin is Literal:
        return tp
    if get_origin(tp) in (Union, types.UnionType) and len(
            [a for a in args if a is not type(None)]) > 1:
        # A number or a word (`every_seconds: 300` or `auto`): Dagster config has no union
        # of scalars, so the form takes any value and the trainer's model checks it.
        return Any
    if _is_optional(tp):
        (inner,) = [a for a in args if a is not type(None)]
        if get_origin(inner) is Literal:
            # Dagster has enums but no optional literal: an optional enum of the same values.
            name = "".join(p[:1].upper() + p[1:] for p in re.split(r"[._]", path))
            inner = enum.Enum(name, {str(v): v for v in get_args(inner)}, type=str)
            return inner | None
        return _form_type(inner, path) | None
    if origin is list:
        return list[_form_type(args[0], path)]
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"config key {path!r}: Dagster config maps have string keys, not {args[0]}")
        return dict[str, _form_type(args[1], path)]
    if tp in (str, int, float, bool) or tp is Any:
        return tp
    raise TypeError(f"config key {path!r}: no Dagster config type for {tp!r}; extend "
                    "ckpt_assets.runs.launch_form")


def _form_field(key: str, info: FieldInfo, tp: Any, top: bool) -> tuple[Any, FieldInfo]:
    """(annotation, field) of the form's key `key`, from the trainer's field `info`; `top`:
    a key of the training config itself, not of one of its sections."""
    description = info.description or ""
    rng = _range_words(info)
    if rng:
        description = f"{description} ({rng})" if description else rng
    if top and key in LAUNCH_DECIDES:
        return tp | None, Field(default=None, description=f"{description}; {LAUNCH_DECIDES[key]}")
    if isinstance(tp, type) and issubclass(tp, dg.Config):
        # A section: its defaults are those of its own keys, shown nested in the launchpad.
        return tp, Field(default_factory=tp, description=description or None)
    if info.default_factory is not None:
        # An explicit default (not a factory), so that the launchpad shows it.
        return tp, Field(default=info.default_factory(), description=description or None)
    if info.default is PydanticUndefined:
        return tp, Field(description=description or None)
    return tp, Field(default=info.default, description=description or None)


@cache
def form_class(model: type[BaseModel]) -> type[dg.Config]:
    """A `dg.Config` with the keys, types, descriptions and defaults of `model`."""
    stem = model.__name__.removesuffix("Config")
    fields = {key: _form_field(key, info, _form_type(info.annotation, f"{stem}.{key}"),
                               top=model is TrainConfig)
              for key, info in model.model_fields.items()}
    return create_model(f"{stem}Form", __base__=dg.Config,
                        __module__=__name__, __doc__=model.__doc__, **fields)


TrainingForm = form_class(TrainConfig)


def training_from_form(form: dg.Config) -> dict[str, Any]:
    """The training config a filled-in form stands for, as the mapping the trainer reads.

    Keys the launch decides and the form left out are dropped, so registration sees exactly
    what it would see for the same config given as a file (the form's other defaults are
    the trainer's, which registration fills in anyway).
    """
    raw = form.model_dump(mode="json")
    return {k: v for k, v in raw.items() if not (k in LAUNCH_DECIDES and v is None)}
