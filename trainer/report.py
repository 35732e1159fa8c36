"""Where the trainer reports progress, committed checkpoints and its failure.

Standalone, reports are log lines. Under Dagster Pipes (DAGSTER_PIPES_CONTEXT set by the
orchestrator) they are also Pipes custom messages; only the small `dagster_pipes` package
is used, never `dagster` itself. One reporter per process (`Reporter.shared()`), because a
Pipes session can be opened only once.
"""

from __future__ import annotations

import atexit
import logging
import os
import traceback
from typing import Any

from trainer.errors import EXIT_USER_ERROR, FAILURE_CLASSES, TrainerError

log = logging.getLogger("trainer")


class Reporter:
    _shared: Reporter | None = None

    def __init__(self) -> None:
        self._pipes = None
        self._pipes_cm = None
        self._closed = False
        if os.environ.get("DAGSTER_PIPES_CONTEXT"):
            from dagster_pipes import open_dagster_pipes

            self._pipes_cm = open_dagster_pipes()
            self._pipes = self._pipes_cm.__enter__()

    @classmethod
    def shared(cls) -> Reporter:
        if cls._shared is None or cls._shared._closed:
            cls._shared = cls()
            atexit.register(cls._shared.close)
        return cls._shared

    def event(self, kind: str, **payload: Any) -> None:
        if self._pipes is not None:
            self._pipes.report_custom_message({"type": kind, **payload})

    def log(self, msg: str, level: int = logging.INFO) -> None:
        log.log(level, msg)
        if self._pipes is not None:
            self._pipes.log.log(level, msg)

    def close(self, error: BaseException | None = None) -> None:
        self._closed = True
        if self._pipes_cm is not None:
            self._pipes_cm.__exit__(type(error) if error else None, error, None)
            self._pipes_cm = self._pipes = None


def report_failure(error: BaseException, reporter: Reporter) -> int:
    """Log `error` once, report it as the attempt's failure, and return its exit code.

    A foreseen error (TrainerError) is one line that says what to do; anything else is a
    bug in training code and keeps its traceback."""
    if isinstance(error, TrainerError):
        code = error.exit_code
        log.error("%s: %s", error.failure_class, error)
    else:
        code = EXIT_USER_ERROR
        log.error("error in training code:\n%s", "".join(traceback.format_exception(error)))
    reporter.event("failed", exit_code=code, failure_class=FAILURE_CLASSES.get(code, "error"),
                   error_type=type(error).__name__, message=str(error),
                   traceback=None if isinstance(error, TrainerError)
                   else "".join(traceback.format_exception(error)))
    return code
