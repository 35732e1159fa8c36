"""Another world size for one launch of a registered run, and for its resumes.

A run's config is registered once and its bytes are the record, but how many ranks train it
is the machines', not the run's: a job that lost a node goes on with fewer, and grows back.
A launch asks with `--nproc-per-node`/`--nnodes` (`ckpt-assets launch`, `run`), which become
the run's world tags (`runs.tags.world_tags`); each resume of that run carries them. What
carries over at another world size: the global batch and the data position, the optimizer's
state, sharded state resharded through DCP (docs/ranks.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from ckpt_assets.base.registration import Registration
from trainer.base.errors import ConfigError
from trainer.config import TrainConfig, config_from_dict


def at_world(reg: Registration, world: Mapping[str, str]) -> Registration:
    """`reg` with the `distributed` keys of `world` (runs.tags.WORLD_TAGS') replaced, checked as
    the registered config was: a batch that no longer splits over the ranks is refused.
    (The registered bytes, `config_uri` and `config_sha256`, stay what was registered.)"""
    return replace(reg, config=world_config(reg.config, world), world_asked=True) if world \
        else reg


def world_config(config: TrainConfig, world: Mapping[str, str]) -> TrainConfig:
    """`config` at the world size `world` asks for, or ConfigError saying what to pass."""
    given = {}
    for key, value in world.items():
        if not str(value).isdigit():
            raise ConfigError(f"distributed.{key} for this launch is {value!r}: pass a whole "
                              "number (ckpt-assets launch --nproc-per-node N --nnodes M)")
        given[key] = int(value)
    raw = config.to_dict()
    try:
        return config_from_dict({**raw, "distributed": {**raw["distributed"], **given}})
    except ConfigError as e:
        asked = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items())
        raise ConfigError(f"{asked}: {e}. The registered config stays the record: pass a "
                          "world size it allows, or register a new run") from None

