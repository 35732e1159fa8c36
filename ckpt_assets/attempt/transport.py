"""How the Pipes context and messages travel between the run worker and the trainer.

`local` (the default): temp files on the run worker's machine, which the trainer it starts
reads and writes (its messages a whole line at a time: `ckpt_assets.attempt.pipes_file`). `s3`: the
context is an object the trainer reads and its messages are
chunks it uploads (dagster-aws's `PipesS3ContextInjector` and `PipesS3MessageReader`), so a
trainer on another machine, sharing no filesystem with Dagster, reports the same events.
Both injected params carry `trainer.process.contract.PipesS3Params`, from which the trainer picks
its loader and writer (`trainer.process.report.pipes_channels`); nothing else is agreed by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

import dagster as dg

from ckpt_assets.attempt.errors import TrainerStartError
from ckpt_assets.attempt.pipes_file import WholeLineTempFileMessageReader
from trainer.base.errors import ConfigError
from trainer.process.contract import PipesS3Params, PipesTransport
from trainer.storage.s3 import validate_bucket

DEFAULT_PIPES_PREFIX = "pipes"  # under the checkpoint store's bucket, when no URI is set


@dataclass(frozen=True)
class PipesChannels:
    """One attempt's Pipes context injector and message reader."""

    context_injector: dg.PipesContextInjector
    message_reader: dg.PipesMessageReader
    transport: PipesTransport = PipesTransport.LOCAL

    @classmethod
    def local(cls) -> PipesChannels:
        return cls(dg.PipesTempFileContextInjector(), WholeLineTempFileMessageReader())


def _bad(message: str) -> Exception:
    return TrainerStartError(message)  # bad input, as any bad start


def s3_location(uri: str) -> tuple[str, str]:
    """(bucket, key prefix ending in '/' or empty) of an s3://bucket/prefix URI."""
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise _bad(f"pipes_s3_uri {uri!r} is not an s3://bucket/prefix URI; set "
                          "TrainerResource.pipes_s3_uri to one, or pipes: local")
    prefix = parsed.path.strip("/")
    try:
        bucket = validate_bucket(parsed.netloc)
    except ConfigError as e:
        raise _bad(f"pipes_s3_uri: {e}") from None
    return bucket, f"{prefix}/" if prefix else ""


def pipes_channels(trainer, store) -> PipesChannels:
    """The channels `trainer` (a TrainerResource) asks for; S3 uses the checkpoint store's
    (a CheckpointStore's) endpoint and credentials, and its bucket unless a URI is set."""
    try:
        transport = PipesTransport(trainer.pipes)
    except ValueError:
        raise _bad(f"TrainerResource.pipes is {trainer.pipes!r}; use one of "
                          f"{', '.join(t.value for t in PipesTransport)}") from None
    if transport is PipesTransport.LOCAL:
        return PipesChannels.local()
    uri = trainer.pipes_s3_uri
    if uri is None:
        if not store.is_s3:
            raise _bad("pipes: s3 needs an S3 location: set TrainerResource."
                              "pipes_s3_uri (s3://bucket/prefix) or use an s3:// store")
        uri = f"s3://{urlparse(store.resolved_uri).netloc}/{DEFAULT_PIPES_PREFIX}"
    from ckpt_assets.attempt.pipes_s3 import (  # dagster-aws: ~0.9 s
        S3ContextInjector,
        S3MessageReader,
    )

    bucket, prefix = s3_location(uri)
    client = store.s3_client()
    marker = PipesS3Params(interval_seconds=trainer.pipes_s3_interval_seconds)
    return PipesChannels(
        S3ContextInjector(bucket=bucket, client=client, key_prefix=prefix, marker=marker),
        S3MessageReader(bucket=bucket, client=client, key_prefix=prefix, marker=marker),
        PipesTransport.S3)
