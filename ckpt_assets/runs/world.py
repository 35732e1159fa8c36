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

from ckpt_assets.runs.registration import Registration
from trainer.config import config_from_dict
from trainer.errors import ConfigError


def at_world(reg: Registration, world: Mapping[str, str]) -> Registration:
    """`reg` with the `distributed` keys of `world` (runs.tags.WORLD_TAGS') replaced, checked as
    the registered config was: a batch that no longer splits over the ranks is refused."""
    if not world:
        return reg
    given = {}
    for key, value in world.items():
        if not str(value).isdigit():
            raise ConfigError(f"distributed.{key} for this launch is {value!r}: pass a whole "
                              "number (ckpt-assets launch --nproc-per-node N --nnodes M)")
        given[key] = int(value)
    raw = reg.config.to_dict()
    return replace(reg, config=config_from_dict(
        {**raw, "distributed": {**raw["distributed"], **given}}))
