"""Where the trainer reports progress, committed checkpoints and its failure.

Standalone, reports are log lines. Under Dagster Pipes (DAGSTER_PIPES_CONTEXT set by the
orchestrator) they are also Pipes custom messages; only the small `dagster_pipes` package
is used, never `dagster` itself.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("trainer")


class Reporter:
    def __init__(self) -> None:
        self._pipes = None
        self._pipes_cm = None
        if os.environ.get("DAGSTER_PIPES_CONTEXT"):
            from dagster_pipes import open_dagster_pipes

            self._pipes_cm = open_dagster_pipes()
            self._pipes = self._pipes_cm.__enter__()

    def event(self, kind: str, **payload: Any) -> None:
        if self._pipes is not None:
            self._pipes.report_custom_message({"type": kind, **payload})

    def log(self, msg: str, level: int = logging.INFO) -> None:
        log.log(level, msg)
        if self._pipes is not None:
            self._pipes.log.log(level, msg)

    def close(self, error: BaseException | None = None) -> None:
        if self._pipes_cm is not None:
            self._pipes_cm.__exit__(type(error) if error else None, error, None)
            self._pipes_cm = self._pipes = None
