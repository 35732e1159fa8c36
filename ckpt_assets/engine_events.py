"""Engine events on a run: words in the run's log whose metadata (a run link) the UI renders.

`EngineEventData` has no public export in Dagster 1.13; this is the one place that imports
it from Dagster's private module, so a Dagster upgrade that moves it changes one line.
"""

from __future__ import annotations

from typing import Any

import dagster as dg
from dagster._core.events import EngineEventData  # no public export in Dagster 1.13


def report_engine_event(instance: dg.DagsterInstance, run: dg.DagsterRun, words: str,
                        metadata: dict[str, Any]) -> None:
    instance.report_engine_event(words, dagster_run=run,
                                 engine_event_data=EngineEventData(metadata=metadata))
