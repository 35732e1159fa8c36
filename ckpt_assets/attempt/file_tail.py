"""Lines of a file another process is still writing, each handed on only once it is whole.

A reader that catches up with the writer in the middle of a write can read the first part
of a line: the kernel makes a write visible page by page, so `readline()` at the end of the
file returns half a line. Both readers of an attempt's files use this: its output
(`ckpt_assets.attempt.process`) and its Pipes messages (`ckpt_assets.attempt.pipes_file`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator


def whole_lines(path: str, should_stop: Callable[[], bool], poll_s: float, *,
                unfinished_last: bool) -> Iterator[str]:
    """Each line appended to `path` (with its newline) once it is whole, until
    `should_stop()` is true and the file has been read to its end; then the last line the
    writer never finished, if `unfinished_last` (an output's last words matter; half a
    message is no message)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        partial = ""
        while True:
            chunk = f.readline()
            if chunk:
                partial += chunk
                if partial.endswith("\n"):
                    yield partial
                    partial = ""
                continue
            if should_stop():
                if partial and unfinished_last:
                    yield partial
                return
            time.sleep(poll_s)
