"""A training process's output as the run's log: a line an entry, a traceback one entry.

One event per frame line would bury the run's log; the structured `failed` report logs the
traceback as an error as well, whole. Both places that read a trainer's output use it: a
process on this machine (`ckpt_assets.attempt.process`) and a Kubernetes pod's log stream
(`ckpt_assets.attempt.k8s_launch`)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

# A Python traceback, as printed: its first line, the chain separators, and the lines that
# continue it (indented frames and source, exception-group borders, blank lines).
TRACEBACK_START = "Traceback (most recent call last):"
CHAIN_LINES = ("During handling of the above exception, another exception occurred:",
               "The above exception was the direct cause of the following exception:")
GROUP_START = "Exception Group Traceback (most recent call last):"  # indented: "  + ..."
BLOCK_IDLE_S = 0.5  # a traceback is written at once; a pause this long ends the block
BLOCK_MAX_LINES = 1000


def _starts(line: str) -> bool:
    return line.startswith(TRACEBACK_START) or line.lstrip(" +").startswith(GROUP_START)


def _continues(line: str, closed: bool) -> bool:
    """Whether `line` belongs to the traceback block being collected: before its exception
    line every line does (frames are indented; the first unindented line is the exception
    line, which `closes` it); after it, only a blank line or a chained traceback does."""
    if _starts(line) or line in CHAIN_LINES or not line.strip():
        return True
    return not closed


def log_output(source: Iterator[str], context) -> None:
    """Log each line of `source` as INFO, and each traceback in it as one entry."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for raw in source:
            lines.put(raw.rstrip())
        lines.put(None)

    threading.Thread(target=read, daemon=True, name="training-output-read").start()
    block: list[str] = []
    closed = False  # the block's exception line was seen

    def flush() -> None:
        nonlocal closed
        if block:
            text = "\n".join(block).rstrip()
            context.log.info(f"[trainer] {text}")
            block.clear()
        closed = False

    while True:
        try:
            line = lines.get(timeout=BLOCK_IDLE_S) if block else lines.get()
        except queue.Empty:
            flush()
            continue
        if line is None:
            flush()
            return
        if block and _continues(line, closed) and len(block) < BLOCK_MAX_LINES:
            if _starts(line) or line in CHAIN_LINES:
                closed = False
            elif line.strip() and line[:1] not in (" ", "\t", "|", "+"):
                closed = True
            block.append(line)
            continue
        flush()
        if _starts(line):
            block.append(line)
        elif line:
            context.log.info(f"[trainer] {line}")
