"""An attempt's processes as its Dagster run records them (tag `ckpt/processes`).

The step that supervises an attempt (`ckpt_assets.attempt.process`) records its run worker
and its training process, the leader of the attempt's process group, each a
`trainer.base.process_id.ProcessId` (machine, pid, start time), and the file their output
goes to; then once more, `ended`, when it saw the group gone. Whoever next looks at a run
whose worker died without recording its end (`ckpt_assets.lifecycle.lost_worker`), and the
next attempt of the partition, read it to stop what the attempt left running.

The tag, since this module: `{"worker": {"pid", "start_ticks", "machine", "pgid"}, "group":
{...}, "output", "ended"}`. Runs recorded before it carry one machine for both and
`{"pid", "start"}` per process; they are read too (`_old_format`), so that they stay
stoppable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import dagster as dg

from ckpt_assets.base.process_group import group_members, stop_group
from ckpt_assets.base.tags import TAG_PROCESSES
from trainer.base.process_id import ProcessId


@dataclass(frozen=True)
class AttemptProcesses:
    """An attempt's processes, as its Dagster run records them."""

    worker: ProcessId  # the run worker (the process that runs the step)
    group: ProcessId  # the training process, leader of its process group
    output: str  # the file its stdout and stderr go to (on the worker's machine)
    ended: bool = False  # the step saw the group gone

    def to_tag(self) -> str:
        return json.dumps({"worker": self.worker.to_dict(), "group": self.group.to_dict(),
                           "output": self.output, "ended": self.ended}, separators=(",", ":"))

    @classmethod
    def of_tag(cls, tag: str) -> AttemptProcesses | None:
        """The processes a `ckpt/processes` tag names, in either format; None for anything
        else (a tag is anyone's to write)."""
        try:
            raw = json.loads(tag)
            if not isinstance(raw, dict):
                return None
            if "machine" in raw:
                return _old_format(raw)
            return cls(ProcessId.from_dict(raw["worker"]), ProcessId.from_dict(raw["group"]),
                       str(raw["output"]), raw.get("ended") is True)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    @classmethod
    def of_run(cls, run: dg.DagsterRun) -> AttemptProcesses | None:
        tag = run.tags.get(TAG_PROCESSES)
        return cls.of_tag(tag) if tag is not None else None

    def worker_gone(self) -> bool:
        """Known dead: it ran on this machine, and its process is gone (or is another now)."""
        return self.worker.gone()

    def left(self) -> list[int]:
        """The live processes of its group, when it ran here (elsewhere: none known)."""
        return group_members(self.group.pid, self.group.start_ticks) if self.group.here() else []

    def stop(self, grace_s: float, log, wait: bool = True) -> list[int]:
        if not self.group.here():
            return []
        return stop_group(self.group.pid, grace_s, log, self.group.start_ticks, wait)


def _old_format(raw: dict[str, Any]) -> AttemptProcesses:
    """A tag written before processes were `ProcessId`s: `{"machine", "worker": {"pid",
    "start"}, "group": {...}, "output", "ended"}` (`start` 0: /proc could not say, and then
    `machine` is null)."""
    machine = raw["machine"]
    if machine is not None and not isinstance(machine, str):
        raise TypeError(f"machine: {machine!r}")

    def process(p: dict[str, Any]) -> ProcessId:
        return ProcessId(int(p["pid"]), int(p["start"]), machine)

    return AttemptProcesses(process(raw["worker"]), process(raw["group"]),
                            str(raw["output"]), bool(raw.get("ended")))
