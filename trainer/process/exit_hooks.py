"""How a session without a `with` block ends as the block would: at interpreter exit, on an
uncaught exception, or on an error of its own; whether the script configured logging (the
session prints its own lines otherwise); and how a process ends at once (`exit_now`)."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
import threading
from typing import NoReturn

from ..base.errors import TrainerError

log = logging.getLogger("trainer")


def logging_configured() -> bool:
    """Would a `trainer` log line reach a handler? (logging's own test before it falls back
    to `logging.lastResort`, which prints warnings and errors only.)"""
    logger: logging.Logger | None = log
    while logger is not None:
        if logger.handlers:
            return True
        logger = logger.parent if logger.propagate else None
    return False


def at_interpreter_exit(func) -> None:
    """Call `func` when the script ends, before thread pools refuse work: concurrent.futures
    shuts its pools down first thing at exit (before `atexit` callbacks), and a commit
    hashes on one. Pipes is closed later, by Reporter's `atexit` callback."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            return register(func)
    except RuntimeError:  # the interpreter is already on its way out
        pass
    atexit.register(func)


def exit_now(code: int) -> NoReturn:
    """End the process with `code` now, its log handlers and output flushed, without the
    interpreter's teardown. Only once everything the process had to say and keep is done:
    atexit callbacks and finalizers do not run."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone: nothing more to say
            pass
    os._exit(code)


def ends_like_the_block(method):
    """Without a `with` block, an error of the session's own ends the process as leaving
    the block would (reported once, its exit code), and so does a stop once committed."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            result = method(self, *args, **kwargs)
        except TrainerError as e:
            if self._in_block or self._finishing:
                raise
            raise SystemExit(self._finish(e)) from None
        if result is True and not self._in_block and not self._finishing:  # step: a stop
            raise SystemExit(self._finish(None))
        return result

    return call
