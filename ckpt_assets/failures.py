"""The failure vocabulary shared by the assets, the failure policy and the sensors.

Exit codes belong to the trainer (`trainer.errors`, documented in the README); a failure
class names what happened to an attempt; a kind groups classes for the policy. A failed
`model_checkpoint` step carries one `TrainingFailure` as its `dagster.Failure` metadata,
and the sensors read the same record back from the event log.
"""

from __future__ import annotations

import dataclasses
import signal
from dataclasses import dataclass
from typing import Any

import dagster as dg

from ckpt_assets.metadata import to_metadata
from trainer.errors import (
    EXIT_BAD_INPUT,
    EXIT_CHECKPOINT_UNLOADABLE,
    EXIT_DIVERGED,
    EXIT_OK,
    EXIT_PREEMPTED,
    EXIT_STORAGE_UNAVAILABLE,
    EXIT_SUPERSEDED,
    EXIT_USER_ERROR,
    FAILURE_CLASSES,
)
from trainer.records import from_known_fields

# Classes the orchestrator adds to the trainer's own (FAILURE_CLASSES).
KILLED_BY_SIGNAL = "killed_by_signal"
NO_CHECKPOINT = "no_checkpoint"  # a command exited 0 without committing a checkpoint

# Kinds: what the policy decides on.
RESUMABLE = {"preempted", "killed", "storage"}
NEVER = {
    "bad_input": "bad config or input: fix the config and register a new run",
    "checkpoint": "no checkpoint of this run could be loaded (corrupt or incompatible)",
    "diverged": "training diverged (NaN/inf loss): lower the learning rate or check the data",
    "bug": "an exception in the training code: fix it, then launch the run again",
    "superseded": "a newer attempt owns this run; it carries on",
    "no_checkpoint": "the command finished without committing a checkpoint; make it "
                     "checkpoint through trainer.CheckpointSession",
    "unknown": "the failure could not be classified; inspect the run's logs",
}
EXIT_KINDS = {EXIT_PREEMPTED: "preempted", 130: "preempted", EXIT_BAD_INPUT: "bad_input",
              EXIT_CHECKPOINT_UNLOADABLE: "checkpoint", EXIT_DIVERGED: "diverged",
              EXIT_USER_ERROR: "bug", EXIT_STORAGE_UNAVAILABLE: "storage",
              EXIT_SUPERSEDED: "superseded", 137: "killed"}
CLASS_KINDS = {"preempted": "preempted", "bad_input": "bad_input",
               "checkpoint_unloadable": "checkpoint", "diverged": "diverged",
               "user_code_error": "bug", "storage_unavailable": "storage",
               "superseded": "superseded", KILLED_BY_SIGNAL: "killed",
               "worker_lost": "killed", "heartbeat_lost": "killed", "interrupted": "preempted",
               NO_CHECKPOINT: "no_checkpoint"}


def signal_name(rc: int) -> str | None:
    """The signal behind an exit status (-N from Popen, or a shell's 128+N)."""
    num = -rc if rc < 0 else rc - 128 if 128 < rc < 160 else None
    if num is None:
        return None
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def failure_class_for(rc: int, reported: str | None = None) -> str:
    """The class of an attempt that exited `rc`; the trainer's own report wins."""
    if rc == EXIT_OK:
        return "success"
    if reported:
        return reported
    if rc == EXIT_PREEMPTED:
        return "preempted"
    if rc < 0 or (128 < rc < 160):
        return KILLED_BY_SIGNAL
    return FAILURE_CLASSES.get(rc, "error")


@dataclass(frozen=True)
class TrainingFailure:
    """How one attempt of a training run ended badly: the metadata of its step failure."""

    exit_code: int
    failure_class: str
    training_run: str
    attempt: int = 0
    last_committed_step: int | None = None
    checkpoint_uri: str | None = None
    signal: str | None = None
    message: str | None = None
    error_type: str | None = None
    dagster_run_id: str | None = None
    root_run_id: str | None = None
    resumed_from_step: int | None = None
    checkpoints_this_attempt: int | None = None

    def to_dagster(self, description: str) -> dg.Failure:
        return dg.Failure(description=description, metadata=to_metadata(dataclasses.asdict(self)))

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> TrainingFailure | None:
        """The record in a step failure's metadata values; None if it is not one."""
        if "exit_code" not in md or "failure_class" not in md:
            return None
        present = {k: v for k, v in md.items() if v is not None}
        return from_known_fields(cls, {**present, "training_run": md.get("training_run") or ""})


FAILURE_METADATA_KEYS = tuple(f.name for f in dataclasses.fields(TrainingFailure))


def bad_input(message: str, run: str, **extra: Any) -> dg.Failure:
    return TrainingFailure(EXIT_BAD_INPUT, "bad_input", run, message=message,
                           **extra).to_dagster(message)


def storage_unavailable(message: str, run: str) -> dg.Failure:
    return TrainingFailure(EXIT_STORAGE_UNAVAILABLE, "storage_unavailable", run,
                           message=message).to_dagster(message)
