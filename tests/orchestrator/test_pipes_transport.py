"""How Pipes travels, decided on the orchestrator's side and read on the trainer's: the
params the orchestrator injects name S3 only when it was configured, and the trainer opens
the S3 loader and writer exactly then (fast: no server, a recording client)."""

from __future__ import annotations

import json
import threading
import time

import dagster as dg
import pytest
from dagster_pipes import (
    DAGSTER_PIPES_CONTEXT_ENV_VAR,
    DAGSTER_PIPES_MESSAGES_ENV_VAR,
    PipesS3ContextLoader,
    PipesS3MessageWriter,
    encode_param,
)

from ckpt_assets.attempt.errors import TrainerStartError
from ckpt_assets.attempt.file_tail import whole_lines
from ckpt_assets.attempt.pipes_file import WholeLineTempFileMessageReader
from ckpt_assets.attempt.pipes_s3 import S3ContextInjector, S3MessageReader
from ckpt_assets.attempt.transport import DEFAULT_PIPES_PREFIX, pipes_channels, s3_location
from ckpt_assets.defs.resources import CheckpointStore, TrainerResource
from tests.polling import wait_for
from trainer.process.contract import PipesS3Params, PipesTransport
from trainer.process.report import pipes_channels as trainer_channels


class RecordingClient:
    def __init__(self) -> None:
        self.put: list[tuple[str, str]] = []
        self.deleted: list[tuple[str, str]] = []

    def put_object(self, Body, Bucket, Key):  # noqa: N803 (boto3's names)
        self.put.append((Bucket, Key))

    def delete_object(self, Bucket, Key):  # noqa: N803
        self.deleted.append((Bucket, Key))


def test_the_s3_params_survive_the_trip_and_nothing_else_reads_as_s3():
    marker = PipesS3Params(interval_seconds=2.5)
    assert PipesS3Params.from_params({"bucket": "b", **marker.to_param()}) == marker
    assert PipesS3Params.from_params({"path": "/tmp/x"}) is None
    assert PipesS3Params.from_params({"bucket": "b", "key": "k"}) is None


def test_the_default_trainer_keeps_pipes_in_local_files():
    channels = pipes_channels(TrainerResource(), CheckpointStore(uri="/tmp/store"))
    assert channels.transport is PipesTransport.LOCAL
    assert isinstance(channels.context_injector, dg.PipesTempFileContextInjector)
    assert isinstance(channels.message_reader, WholeLineTempFileMessageReader)


@pytest.mark.parametrize("trainer,store,says", [
    (TrainerResource(pipes="sftp"), CheckpointStore(uri="/tmp/s"), "use one of local, s3"),
    (TrainerResource(pipes="s3"), CheckpointStore(uri="/tmp/s"), "set TrainerResource.pipes_s3_uri"),
    (TrainerResource(pipes="s3", pipes_s3_uri="/tmp/p"), CheckpointStore(uri="/tmp/s"),
     "is not an s3://bucket/prefix URI"),
    (TrainerResource(pipes="s3", pipes_s3_uri="s3://a/p"), CheckpointStore(uri="/tmp/s"),
     "invalid S3 bucket name"),
])
def test_a_bad_pipes_setting_is_a_bad_launch_that_says_what_to_set(trainer, store, says):
    with pytest.raises(TrainerStartError, match=says):
        pipes_channels(trainer, store)


def test_s3_pipes_default_to_the_checkpoint_stores_bucket(aws_env):
    channels = pipes_channels(TrainerResource(pipes="s3"),
                              CheckpointStore(uri="s3://team-bucket/ckpts"))
    assert channels.transport is PipesTransport.S3
    assert channels.message_reader.bucket == "team-bucket"
    assert channels.message_reader.key_prefix == f"{DEFAULT_PIPES_PREFIX}/"
    assert s3_location("s3://b-1/a/b/") == ("b-1", "a/b/")
    assert s3_location("s3://b-1") == ("b-1", "")


def test_the_injected_s3_params_name_the_prefix_and_tell_the_trainer_to_use_s3():
    client, marker = RecordingClient(), PipesS3Params(interval_seconds=0.5)
    injector = S3ContextInjector(bucket="bkt", client=client, key_prefix="pp/", marker=marker)
    with injector.inject_context({"asset_keys": None}) as params:
        assert client.put == [("bkt", params["key"])] and params["key"].startswith("pp/")
        assert PipesS3Params.from_params(params) == marker
    assert client.deleted == client.put  # the context object does not outlive the session
    reader = S3MessageReader(bucket="bkt", client=client, key_prefix="pp/", marker=marker)
    assert reader.interval == 0.5
    with reader.get_params() as params:
        assert params["bucket"] == "bkt" and params["key_prefix"].startswith("pp/")
        assert PipesS3Params.from_params(params) == marker


def test_the_trainer_opens_s3_pipes_only_when_the_params_say_so(aws_env, monkeypatch):
    marker = PipesS3Params(interval_seconds=0.5)
    monkeypatch.setenv(DAGSTER_PIPES_CONTEXT_ENV_VAR,
                       encode_param({"bucket": "b", "key": "k", **marker.to_param()}))
    monkeypatch.setenv(DAGSTER_PIPES_MESSAGES_ENV_VAR,
                       encode_param({"bucket": "b", "key_prefix": "p", **marker.to_param()}))
    chosen = trainer_channels()
    assert isinstance(chosen["context_loader"], PipesS3ContextLoader)
    assert isinstance(chosen["message_writer"], PipesS3MessageWriter)
    assert chosen["message_writer"].interval == 0.5
    monkeypatch.setenv(DAGSTER_PIPES_CONTEXT_ENV_VAR, encode_param({"path": "/tmp/c"}))
    monkeypatch.setenv(DAGSTER_PIPES_MESSAGES_ENV_VAR, encode_param({"path": "/tmp/m"}))
    assert trainer_channels() == {}


@pytest.mark.parametrize("unfinished_last", [False, True])
def test_a_line_read_half_written_is_handed_on_only_once_it_is_whole(tmp_path, unfinished_last):
    """The reader catches up with the writer mid-line (as it can when a write crosses a page):
    it waits for the newline instead of handing on half a message, and every later line still
    arrives. A last line the writer never finished is dropped from messages, kept in output."""
    path = tmp_path / "messages"
    first = json.dumps({"method": "opened", "params": {}}) + "\n"
    second = json.dumps({"method": "report_custom_message", "params": {"payload": "x" * 300}})
    path.write_text(first + second[:143])
    done, got = threading.Event(), []

    def read() -> None:
        got.extend(whole_lines(str(path), done.is_set, 0.01, unfinished_last=unfinished_last))

    reader = threading.Thread(target=read)
    reader.start()
    wait_for(lambda: got, 10, what="the whole first line")
    time.sleep(0.05)  # several polls of the half-written line
    assert got == [first]
    with path.open("a") as f:
        f.write(second[143:] + "\n" + '{"method": "clo')
    done.set()
    reader.join(10)
    assert got == [first, second + "\n"] + (['{"method": "clo'] if unfinished_last else [])
