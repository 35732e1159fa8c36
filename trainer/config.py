"""Training config: a JSON/YAML file checked strictly against these dataclasses.

Unknown keys, wrong types and values out of range are refused with the path of the
offending key, so a typo never silently trains with a default and a value the optimizer
would refuse never gets as far as a traceback.

A config runs one of two ways: a `task` (`package.module:function`, the trainer owns the
loop) or a `command` (the user's own script, which owns its loop and checkpoints through
`trainer.CheckpointSession`); only the orchestrator starts commands.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer.errors import ConfigError
from trainer.storage import validate_name


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0


MAX_HEARTBEAT_S = 60.0


@dataclass
class CheckpointConfig:
    every_steps: int | None = 50
    every_seconds: float | None = None
    on_epoch_end: bool = True
    on_best: bool = True
    keep_last: int = 3
    keep_best: bool = True
    async_save: bool = False
    # Liveness: the reconciler declares a run dead when its heartbeat is older than
    # CKPT_HEARTBEAT_TIMEOUT_S (120 s), so a heartbeat is not optional. 0: every step.
    heartbeat_seconds: float = 5.0


@dataclass
class DataConfig:
    shuffle: bool = True  # false: the dataset's own order (text read in sequence)
    num_workers: int = 0  # DataLoader worker processes


@dataclass
class AmpConfig:
    dtype: str | None = None  # bfloat16 (CPU and CUDA) or float16 (with a GradScaler)


@dataclass
class TrainConfig:
    run: str = "run"
    experiment: str = "default"
    task: str = "trainer.tasks.toy:build"
    task_args: dict[str, Any] = field(default_factory=dict)
    # The data the run trains on: a path, file:///abs/path or s3://bucket/prefix; null when
    # the task generates its own. Versioned by a content manifest (trainer.dataset).
    dataset: str | None = None
    seed: int = 0
    max_steps: int = 200
    batch_size: int = 32
    grad_accum_steps: int = 1
    eval_every: int = 50
    threads: int = 1
    deterministic: bool = True
    device: str = "auto"
    amp: AmpConfig = field(default_factory=AmpConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # Command mode (instead of `task`): the user's script, run by the orchestrator with the
    # checkpoint to resume from passed as `resume_flag URI` and in $`resume_env`.
    command: list[str] | None = None
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    resume_flag: str | None = "--resume-from"
    resume_env: str | None = "CKPT_RESUME_FROM"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _check(value, a, path)
            except ConfigError:
                pass
        raise ConfigError(f"config key {path!r}: expected {tp}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        return from_mapping(tp, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"config key {path!r}: expected a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_check(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {path!r}: expected a mapping, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"config key {path!r}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"config key {path!r}: expected a finite number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key {path!r}: expected an integer, got {value!r}")
        return value
    if tp is bool or tp is str:
        if not isinstance(value, tp):
            raise ConfigError(f"config key {path!r}: expected {tp.__name__}, got {value!r}")
        return value
    return value


def from_mapping(cls: type, raw: Any, path: str = "") -> Any:
    """An instance of config dataclass `cls` from `raw`, checked strictly (ConfigError)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path or 'file'}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        where = f" in {path!r}" if path else ""
        raise ConfigError(
            f"unknown config key(s){where}: {', '.join(unknown)}. Allowed: {', '.join(sorted(names))}"
        )
    kwargs = {k: _check(v, hints[k], f"{path}.{k}" if path else k) for k, v in raw.items()}
    return cls(**kwargs)


def _require(ok: bool, key: str, rule: str) -> None:
    if not ok:
        raise ConfigError(f"config key {key!r} must be {rule}")


def _check_ranges(cfg: TrainConfig) -> None:
    """Values the types allow but training would refuse (or silently misuse)."""
    _require(cfg.max_steps >= 1, "max_steps", "at least 1")
    _require(cfg.batch_size >= 1, "batch_size", "at least 1")
    _require(cfg.grad_accum_steps >= 1, "grad_accum_steps", "at least 1")
    _require(cfg.eval_every >= 0, "eval_every", "0 (never) or more")
    _require(cfg.threads >= 1, "threads", "at least 1")
    _require(cfg.data.num_workers >= 0, "data.num_workers", "0 or more")
    _require(cfg.amp.dtype in (None, "bfloat16", "float16"), "amp.dtype",
             "bfloat16, float16 or null")
    o = cfg.optim
    _require(o.lr > 0, "optim.lr", "positive")
    _require(o.weight_decay >= 0, "optim.weight_decay", "0 or more")
    _require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas",
             "two numbers in [0, 1)")
    _require(o.warmup_steps >= 0, "optim.warmup_steps", "0 or more")
    _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "between 0 and 1")
    _require(o.grad_clip >= 0, "optim.grad_clip", "0 (off) or more")
    check_triggers(cfg.checkpoint)


def check_triggers(ck: CheckpointConfig) -> CheckpointConfig:
    _require(ck.every_steps is None or ck.every_steps >= 1, "checkpoint.every_steps",
             "at least 1 (or null)")
    _require(ck.every_seconds is None or ck.every_seconds > 0, "checkpoint.every_seconds",
             "positive (or null)")
    _require(ck.keep_last >= 1, "checkpoint.keep_last", "at least 1")
    _require(0 <= ck.heartbeat_seconds <= MAX_HEARTBEAT_S, "checkpoint.heartbeat_seconds",
             f"between 0 (every step) and {MAX_HEARTBEAT_S:.0f}: the orchestrator declares a "
             "run dead when its heartbeat stops, so it cannot be turned off")
    return ck


def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    cfg = from_mapping(TrainConfig, raw)
    validate_name(cfg.experiment, "experiment name")
    validate_name(cfg.run, "run name")
    _check_ranges(cfg)
    if cfg.command is not None:
        if not cfg.command or not all(isinstance(a, str) and a for a in cfg.command):
            raise ConfigError("config key 'command' must be a non-empty list of arguments, "
                              "e.g. [python, train.py, --epochs, '3']")
    elif ":" not in cfg.task:
        raise ConfigError(
            f"config key 'task' is {cfg.task!r}: expected 'package.module:function'"
        )
    return cfg


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors and aliases: a few hundred bytes of aliases can expand to
    millions of values (a 'billion laughs'), and configs have no need for them."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            event = self.peek_event()
            raise ConfigError(f"YAML aliases (*{event.anchor}) are not allowed in a config "
                              f"(line {event.start_mark.line + 1}); write the values out")
        return super().compose_node(parent, index)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a JSON or YAML config file; ConfigError says what is wrong."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist; pass --config with a JSON or YAML file") from None
    except OSError as e:
        raise ConfigError(f"config file {p} cannot be read: {e.strerror}") from None
    yaml_file = p.suffix in (".yaml", ".yml")
    try:
        if yaml_file:
            raw = yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 (a safe loader)
        else:
            raw = json.loads(text)
    except ConfigError:
        raise
    except Exception as e:  # any parse error is bad input
        raise ConfigError(f"config file {p} is not valid {'YAML' if yaml_file else 'JSON'}: {e}") from None
    return raw or {}


def load_config(path: str | Path) -> TrainConfig:
    return config_from_dict(read_config_file(path))
