"""How an attempt ended, as the assets record it and the policy and sensors read it back.

The vocabulary (classes, exit codes, kinds, what is resumed) is `trainer.base.outcomes`; this is
the one record over it. A failed `model_checkpoint` step carries one `AttemptEnd` as its
`dagster.Failure` metadata, the `attempt_ended` observation carries the same fields (also on
success), and the sensors read the record back from the event log, or build one for a run
that ended without recording it (its worker was lost, it was terminated, its heartbeat
stopped).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import dagster as dg

from ckpt_assets.base.metadata import to_metadata
from trainer.base.outcomes import Kind, Outcome
from trainer.checkpoints.records import CheckpointRecord, from_known_fields


@dataclass(frozen=True)
class AttemptEnd:
    """How one attempt of a training run ended: a success is an outcome like the others."""

    outcome: Outcome
    training_run: str
    exit_code: int | None = None  # the trainer's; None when nobody saw it exit
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

    @property
    def kind(self) -> Kind:
        return self.outcome.kind

    @property
    def failure_class(self) -> str:
        """The outcome's class name, as recorded in metadata, tags and MLflow."""
        return self.outcome.value

    def to_dict(self) -> dict[str, Any]:
        """Plain values: the outcome as its class name (`failure_class`), as recorded."""
        values = dataclasses.asdict(self)
        values.pop("outcome")
        return {"failure_class": self.failure_class, **values}

    def to_dagster(self, description: str) -> dg.Failure:
        return dg.Failure(description=description, metadata=to_metadata(self.to_dict()),
                          allow_retries=False)

    @classmethod
    def from_metadata(cls, md: dict[str, Any]) -> AttemptEnd | None:
        """The record in a step failure's metadata values; None if it is not one."""
        outcome = Outcome.parse(md.get("failure_class"))
        if outcome is None:
            return None
        present = {k: v for k, v in md.items() if v is not None}
        return from_known_fields(cls, {**present, "outcome": outcome,
                                       "training_run": md.get("training_run") or ""})


FAILURE_METADATA_KEYS = tuple(AttemptEnd(Outcome.UNKNOWN, "").to_dict())


def bad_input(message: str, run: str, **extra: Any) -> dg.Failure:
    return AttemptEnd(Outcome.BAD_INPUT, run, Outcome.BAD_INPUT.exit_code, message=message,
                      **extra).to_dagster(message)


def storage_unavailable(message: str, run: str) -> dg.Failure:
    return AttemptEnd(Outcome.STORAGE_UNAVAILABLE, run, Outcome.STORAGE_UNAVAILABLE.exit_code,
                      message=message).to_dagster(message)


def checkpoint_unloadable(message: str, run: str, ck: CheckpointRecord) -> dg.Failure:
    return AttemptEnd(Outcome.CHECKPOINT_UNLOADABLE, run,
                      Outcome.CHECKPOINT_UNLOADABLE.exit_code, last_committed_step=ck.step,
                      checkpoint_uri=ck.uri, message=message).to_dagster(message)
