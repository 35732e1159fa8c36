"""Training config: a JSON/YAML file checked strictly against these dataclasses.

Unknown keys and wrong types are refused with the path of the offending key, so a typo
never silently trains with a default.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


@dataclass
class CheckpointConfig:
    every_steps: int | None = 50
    every_seconds: float | None = None
    on_epoch_end: bool = True
    on_best: bool = True
    keep_last: int = 3
    keep_best: bool = True
    async_save: bool = False
    heartbeat_seconds: float | None = 5.0  # 0: every step; null: never


@dataclass
class TrainConfig:
    run: str = "run"
    experiment: str = "default"
    task: str = "trainer.tasks.toy:build"
    task_args: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    max_steps: int = 200
    batch_size: int = 32
    eval_every: int = 50
    threads: int = 1
    deterministic: bool = True
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

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
        return _build(tp, value, path)
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


def _build(cls: type, raw: Any, path: str) -> Any:
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


def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    cfg = _build(TrainConfig, raw, "")
    validate_name(cfg.experiment, "experiment name")
    validate_name(cfg.run, "run name")
    if cfg.max_steps < 1:
        raise ConfigError("config key 'max_steps' must be at least 1")
    if cfg.batch_size < 1:
        raise ConfigError("config key 'batch_size' must be at least 1")
    if cfg.threads < 1:
        raise ConfigError("config key 'threads' must be at least 1")
    ck = cfg.checkpoint
    if ck.every_steps is not None and ck.every_steps < 1:
        raise ConfigError("config key 'checkpoint.every_steps' must be at least 1 (or null)")
    if ck.every_seconds is not None and ck.every_seconds <= 0:
        raise ConfigError("config key 'checkpoint.every_seconds' must be positive (or null)")
    if ck.keep_last < 1:
        raise ConfigError("config key 'checkpoint.keep_last' must be at least 1")
    if ":" not in cfg.task:
        raise ConfigError(
            f"config key 'task' is {cfg.task!r}: expected 'package.module:function'"
        )
    return cfg


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
            import yaml

            raw = yaml.safe_load(text)
        else:
            raw = json.loads(text)
    except Exception as e:  # any parse error is bad input
        raise ConfigError(f"config file {p} is not valid {'YAML' if yaml_file else 'JSON'}: {e}") from None
    return raw or {}


def load_config(path: str | Path) -> TrainConfig:
    return config_from_dict(read_config_file(path))
