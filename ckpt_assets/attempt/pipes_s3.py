"""The Pipes channels over S3: dagster-aws's context injector and message reader, told to
let the trainer know where it reads and writes them (`trainer.process.contract.PipesS3Params`).

Apart from `ckpt_assets.attempt.transport` because importing dagster-aws's Pipes takes about
0.9 s (it loads its components, and they Dagster's test utilities): only a run whose trainer
shares no disk with Dagster pays it, not every run worker, code server and CLI call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dagster_aws.pipes import PipesS3ContextInjector, PipesS3MessageReader

from trainer.process.contract import PipesS3Params


class S3ContextInjector(PipesS3ContextInjector):
    """dagster-aws's injector, whose params also tell the trainer to read them from S3."""

    def __init__(self, *, marker: PipesS3Params, **kwargs: Any):
        super().__init__(**kwargs)
        self.marker = marker

    @contextmanager
    def inject_context(self, context) -> Iterator[dict[str, Any]]:
        with super().inject_context(context) as params:
            yield {**params, **self.marker.to_param()}


class S3MessageReader(PipesS3MessageReader):
    """dagster-aws's reader, with its chunks under our prefix (not the bucket's root) and
    params that tell the trainer to upload them there."""

    def __init__(self, *, marker: PipesS3Params, key_prefix: str, **kwargs: Any):
        super().__init__(interval=marker.interval_seconds, **kwargs)
        self.marker = marker
        self.key_prefix = key_prefix

    @contextmanager
    def get_params(self) -> Iterator[dict[str, Any]]:
        with super().get_params() as params:
            yield {**params, "key_prefix": self.key_prefix + params["key_prefix"],
                   **self.marker.to_param()}
