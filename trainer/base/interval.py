"""The checkpoint interval that sets itself (`checkpoint.every_seconds: auto`).

Young/Daly: with a checkpoint costing C seconds of training and failures arriving every
MTBF seconds on average, the interval that loses the least time (to checkpoints plus to
work redone after a failure) is T = sqrt(2 * C * MTBF). C is the stall a checkpoint
causes on the training thread (the snapshot, not the background write: training goes on
during that), measured at every save; the MTBF comes from the experiment's failure history,
which the orchestrator reads from its instance at each launch (`trainer.process.contract`), or
from the config when the trainer runs on its own or no attempt of the experiment failed
yet.

The interval is never shorter than the last background write took: at most one save is
in flight, so a shorter one would make the next save wait for the previous write.
Pure Python: the orchestrator imports the records below too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

AUTO = "auto"  # the value of `checkpoint.every_seconds` that turns this on
# Until the first save measured it: a guess at a checkpoint's stall (a synchronous save of
# a few GB). Any trigger's save replaces it with a measurement.
ASSUMED_STALL_S = 1.0
STALL_WINDOW = 5  # the median of the last few stalls: one slow save does not swing it


class MtbfSource(StrEnum):
    HISTORY = "history"  # failures of the experiment's runs over their wall time
    CONFIG = "config"  # `checkpoint.mtbf_seconds`: no failure recorded yet, or standalone


@dataclass(frozen=True)
class Mtbf:
    """Mean time between failures, and where the figure comes from."""

    seconds: float
    source: MtbfSource = MtbfSource.CONFIG
    failures: int = 0  # failures counted (history)
    observed_seconds: float = 0.0  # the training wall time they happened in

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Mtbf:
        raw = json.loads(text)
        return cls(seconds=float(raw["seconds"]), source=MtbfSource(raw["source"]),
                   failures=int(raw.get("failures", 0)),
                   observed_seconds=float(raw.get("observed_seconds", 0.0)))


@dataclass(frozen=True)
class IntervalChoice:
    """The interval chosen for the next checkpoint, with its inputs (recorded in metadata)."""

    every_seconds: float
    stall_seconds: float  # C
    stall_measured: bool  # False: ASSUMED_STALL_S, no save measured yet
    mtbf_seconds: float
    mtbf_source: str
    mtbf_failures: int = 0
    write_seconds: float | None = None  # the last background write: the interval's floor

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> IntervalChoice | None:
        if not isinstance(raw, dict):
            return None
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in raw.items() if k in names})
        except TypeError:  # a record from another version: not worth failing a report
            return None


def young_daly(stall_s: float, mtbf_s: float) -> float:
    """The first-order optimal checkpoint interval, sqrt(2 * C * MTBF)."""
    return math.sqrt(2.0 * max(stall_s, 0.0) * mtbf_s)


class AutoInterval:
    """The interval, recomputed as stall measurements arrive (from the save worker too)."""

    def __init__(self, mtbf: Mtbf):
        self.mtbf = mtbf
        self._stalls: list[float] = []
        self._write_s: float | None = None
        self._choice = self._compute()

    def observe(self, stall_s: float | None, write_s: float | None = None) -> None:
        """A save's stall on the training thread, and how long its write took."""
        if stall_s is not None:
            self._stalls = [*self._stalls[-(STALL_WINDOW - 1):], float(stall_s)]
        if write_s is not None:
            self._write_s = float(write_s)
        self._choice = self._compute()

    @property
    def choice(self) -> IntervalChoice:
        return self._choice

    @property
    def every_seconds(self) -> float:
        return self._choice.every_seconds

    def _compute(self) -> IntervalChoice:
        measured = bool(self._stalls)
        stall = statistics.median(self._stalls) if measured else ASSUMED_STALL_S
        every = max(young_daly(stall, self.mtbf.seconds), self._write_s or 0.0)
        return IntervalChoice(every_seconds=round(every, 3), stall_seconds=round(stall, 6),
                              stall_measured=measured, mtbf_seconds=round(self.mtbf.seconds, 1),
                              mtbf_source=self.mtbf.source.value,
                              mtbf_failures=self.mtbf.failures,
                              write_seconds=None if self._write_s is None
                              else round(self._write_s, 4))



class SaveInterval:
    """The session's time trigger: off, a fixed number of seconds, or `auto`."""

    def __init__(self, every_seconds: float | str | None, mtbf_default_s: float,
                 told: Mtbf | None):
        """`told`: the MTBF the orchestrator computed for this attempt (standalone: None,
        and the config's default holds)."""
        self.fixed = None if every_seconds == AUTO else every_seconds
        self.auto = AutoInterval(told or Mtbf(float(mtbf_default_s))) \
            if every_seconds == AUTO else None

    @property
    def every_seconds(self) -> float | None:
        return self.auto.every_seconds if self.auto else self.fixed

    def due(self, since_last_save_s: float) -> bool:
        every = self.every_seconds
        return bool(every) and since_last_save_s >= every

    def observe(self, stats: dict[str, Any]) -> None:
        """A committed save's figures (`blocking_seconds`, `write_seconds`)."""
        if self.auto:
            self.auto.observe(stats.get("blocking_seconds"), stats.get("write_seconds"))

    def meta(self) -> dict[str, Any]:
        """What a checkpoint's manifest records of the interval: the choice and its inputs."""
        return {"interval": self.auto.choice.to_dict()} if self.auto else {}
