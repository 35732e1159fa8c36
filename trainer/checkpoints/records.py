"""Typed records the trainer reports and the orchestrator reads: lineage and checkpoints.

One definition each, serialized to plain dicts for Pipes messages and manifests and read
back with `from_dict`, so no side spells the same record out as a dict of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..base.interval import IntervalChoice
from ..base.process_id import ProcessId

if TYPE_CHECKING:
    from .manifest import Manifest


def from_known_fields(cls: type, raw: dict[str, Any] | None) -> Any:
    """An instance of dataclass `cls` from the keys of `raw` it has fields for (records
    gain fields over time: a reader ignores what it does not know)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in (raw or {}).items() if k in names})


@dataclass(frozen=True)
class Lineage:
    """Where a checkpoint came from: recorded in its manifest and in every report of it."""

    experiment: str
    run: str
    attempt: int
    dagster_run_id: str | None = None
    root_run_id: str | None = None
    resumed_from_step: int | None = None
    code_version: str | None = None  # ckpt-assets itself
    user_code_version: str | None = None  # the repository (or files) of the code trained
    data_version: str | None = None
    dataset: str | None = None  # the dataset's URI, when it is one

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> Lineage:
        return from_known_fields(cls, {"experiment": "", "run": "", "attempt": 0, **(raw or {})})


@dataclass(frozen=True)
class CheckpointRecord:
    """A committed checkpoint as the trainer reports it (Pipes message `checkpoint`)."""

    name: str
    uri: str
    step: int
    attempt: int
    sha256: str
    size: int
    parent: str | None = None
    loss: float | None = None
    eval: dict[str, float] = field(default_factory=dict)
    reason: str | None = None
    save_seconds: float | None = None
    blocking_seconds: float | None = None  # the training thread's stall for this save
    lineage: Lineage | None = None
    # Bytes of tensor data per part (model, optimizer, ..., the session's loop and rng).
    part_bytes: dict[str, int] = field(default_factory=dict)
    # The run's end: the step reached max_steps, or the script's session ended normally
    # there. Only a final checkpoint finishes a run (and becomes final_model).
    final: bool = False
    interval: IntervalChoice | None = None  # `every_seconds: auto`: the interval and its inputs

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["lineage"] = self.lineage.to_dict() if self.lineage else None
        return d

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CheckpointRecord:
        rec = from_known_fields(cls, raw)
        lin = raw.get("lineage")
        return dataclasses.replace(rec, lineage=Lineage.from_dict(lin) if lin else None,
                                   eval=dict(raw.get("eval") or {}),
                                   part_bytes=dict(raw.get("part_bytes") or {}),
                                   interval=IntervalChoice.from_dict(raw.get("interval")))

    @classmethod
    def from_manifest(cls, m: Manifest, uri: str,
                      stats: dict[str, Any] | None = None) -> CheckpointRecord:
        """The record of committed checkpoint `m` (stored at `uri`)."""
        stats = stats or {}
        lin = m.meta.get("lineage")
        return cls(name=m.name, uri=uri, step=m.step, attempt=m.attempt, sha256=m.sha256,
                   size=m.total_size, parent=m.parent, loss=m.meta.get("loss"),
                   eval=dict(m.meta.get("metrics") or {}), reason=m.meta.get("reason"),
                   save_seconds=stats.get("save_seconds"),
                   blocking_seconds=stats.get("blocking_seconds",
                                              m.meta.get("blocking_seconds")),
                   lineage=Lineage.from_dict(lin) if lin else None,
                   part_bytes=dict(m.meta.get("part_bytes") or {}),
                   final=m.meta.get("final") is True,
                   interval=IntervalChoice.from_dict(m.meta.get("interval")))


@dataclass(frozen=True)
class Beat:
    """heartbeat.json: who is training the run, whether it is alive, and how far it got."""

    time: float  # when this beat was written (the trainer's clock)
    pid: int
    step: int | None = None  # the last completed step; the resumed step before the first
    step_time: float | None = None  # when `step` was reached (or the attempt started)
    attempt: int | None = None  # the attempt this process claimed (None before its claim)
    resumed_step: int | None = None  # the step this attempt continued from (0: fresh)
    owner: str | None = None  # the claim's owner token, as in latest.json
    dagster_run_id: str | None = None  # the Dagster run that launched it, if any
    ended: float | None = None  # when the session ended (its last beat)
    host: str | None = None  # the writer's host name, for people
    # The writer (`ProcessId`); a beat of an older trainer names no machine, and its
    # writer is never signalled (its launcher is asked to stop it).
    machine: str | None = None
    pgid: int | None = None
    start_ticks: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> Beat | None:
        """The beat in a heartbeat file's JSON; None for anything that is not one."""
        if not isinstance(raw, dict):
            return None
        try:
            beat = from_known_fields(cls, raw)
            return dataclasses.replace(beat, time=float(beat.time), pid=int(beat.pid))
        except (TypeError, ValueError):
            return None

    @property
    def process(self) -> ProcessId:
        """The process that wrote it."""
        return ProcessId(self.pid, self.start_ticks, self.machine, self.pgid)
