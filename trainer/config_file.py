"""A training config file read: JSON or YAML, local or on S3, as a plain mapping.

`trainer.config` checks what it holds; this is only the reading, with what a file can get
wrong said by the file's name (no mapping, YAML anchors, unreadable)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from .base.errors import ConfigError
from .config import TrainConfig, config_from_dict


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors and aliases: a few hundred bytes of aliases can expand to
    millions of values (a 'billion laughs'), and configs have no need for them."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.events.AliasEvent):
            event = self.peek_event()
            raise ConfigError(f"YAML aliases (*{event.anchor}) are not allowed in a config "
                              f"(line {event.start_mark.line + 1}); write the values out")
        return super().compose_node(parent, index)


def _read_s3_text(uri: str) -> str:
    from .storage.s3 import read_uri

    return read_uri(uri).decode("utf-8")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a JSON or YAML config file (a path, or an s3://bucket/key object:
    a trainer on another machine reads the registered config from the store); ConfigError
    says what is wrong."""
    p = Path(path)
    try:
        text = _read_s3_text(str(path)) if str(path).startswith("s3://") else p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass --config with a JSON or "
                          "YAML file") from None
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
    if not isinstance(raw, dict):
        # An empty file, `null` or `[]` would otherwise register an all-defaults run.
        raise ConfigError(f"config file {path} holds {json.dumps(raw)[:40]}, not a mapping of "
                          "config keys; write the run's keys (task, max_steps, ...) in it")
    return raw


def load_config(path: str | Path) -> TrainConfig:
    return config_from_dict(read_config_file(path))
