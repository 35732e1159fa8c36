"""The local transport's message reader: the trainer's messages file, a whole line at a time.

Dagster's `PipesFileMessageReader` hands `json.loads` whatever `readline()` returns, so a
message read half written (`ckpt_assets.attempt.file_tail` says how) killed its reader thread with a
`JSONDecodeError`, and every later message of the attempt was lost. Seen on a busy machine:
a finished attempt's last checkpoint report and Pipes' closed message never arrived
("framework exception occurred in PipesFileMessageReader reader thread"), and MLflow missed
the run's last step.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg

from ckpt_assets.attempt.file_tail import whole_lines

POLL_S = 0.01  # Dagster's own tail interval
MESSAGES_FILE = "messages"


class WholeLineFileMessageReader(dg.PipesFileMessageReader):
    """`PipesFileMessageReader` whose thread reads whole lines only (`whole_lines`)."""

    def _reader_thread(self, handler, is_resource_complete) -> None:
        try:
            for line in whole_lines(self._path, is_resource_complete.is_set, POLL_S,
                                    unfinished_last=False):
                handler.handle_message(json.loads(line))
        except:  # noqa: E722 - reported to the step as Dagster's own reader does, then raised
            handler.report_pipes_framework_exception(
                f"{self.__class__.__name__} reader thread", sys.exc_info())
            raise


class WholeLineTempFileMessageReader(dg.PipesTempFileMessageReader):
    """`PipesTempFileMessageReader` (a file in a new temporary directory) that reads it with
    `WholeLineFileMessageReader`."""

    @contextmanager
    def read_messages(self, handler) -> Iterator[dg.PipesParams]:
        with tempfile.TemporaryDirectory() as tempdir:
            reader = WholeLineFileMessageReader(os.path.join(tempdir, MESSAGES_FILE))
            with reader.read_messages(handler) as params:
                yield params
