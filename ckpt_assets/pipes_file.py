"""The local transport's message reader: the trainer's messages file, read a whole line at a
time.

Dagster's `PipesFileMessageReader` hands `json.loads` whatever `readline()` returns. A
reader that catches up with the writer in the middle of a write gets the first part of a
line: the kernel makes a write visible page by page, so a message that crosses a page
boundary can be read half written. The reader thread then dies on the `JSONDecodeError`
and every later message of the attempt is lost. Seen on a busy machine: a finished attempt's
last checkpoint report and Pipes' closed message never arrived ("framework exception
occurred in PipesFileMessageReader reader thread: JSONDecodeError"), so MLflow missed the
run's last step. This reader keeps a line until its newline has arrived.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import dagster as dg

POLL_S = 0.01  # Dagster's own tail interval
MESSAGES_FILE = "messages"


def whole_lines(path: str, should_stop: Callable[[], bool]) -> Iterator[str]:
    """Each complete line appended to `path`, without its newline, until `should_stop()` is
    true and everything written so far has been read. A last line that never got its
    newline (the writer died mid-write) is not a message, and is dropped."""
    pending = b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 16)
            if chunk:
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        yield line.decode("utf-8")
            elif should_stop():
                return
            else:
                time.sleep(POLL_S)


class WholeLineFileMessageReader(dg.PipesFileMessageReader):
    """`PipesFileMessageReader` whose thread reads whole lines only (`whole_lines`)."""

    def _reader_thread(self, handler, is_resource_complete) -> None:
        try:
            for line in whole_lines(self._path, is_resource_complete.is_set):
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
