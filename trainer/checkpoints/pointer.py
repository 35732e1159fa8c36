"""latest.json: the run's current checkpoint, the ones before it, and its owner."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..base import strict_json
from ..base.errors import CheckpointError
from .manifest import checked_count, checked_name, checked_type


@dataclass(frozen=True)
class Best:
    checkpoint: str
    score: float | None


@dataclass(frozen=True)
class Pointer:
    """latest.json: the run's current checkpoint and the ones before it, newest first.

    `generation` grows by one with every move; `attempt` is the attempt that owns the run
    (set by its claim, before it has committed anything); `fenced_through` is the highest
    attempt the orchestrator declared failed (`CheckpointRepo.fence`): none of those may
    claim the run again."""

    generation: int = 0
    checkpoint: str | None = None
    step: int | None = None
    attempt: int = 0
    history: tuple[str, ...] = ()
    best: Best | None = None
    owner: str | None = None
    updated_at: float | None = None
    fenced_through: int = 0

    @property
    def timeline(self) -> list[str]:
        """Checkpoints the pointer has named, newest first."""
        return [n for n in (self.checkpoint, *self.history) if n]

    def to_json(self) -> bytes:
        body = {**self.__dict__, "history": list(self.history),
                "best": self.best.__dict__ if self.best else None}
        return strict_json.dumps(body, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Pointer:
        """Parse and type-check latest.json; anything else raises CheckpointError.

        Every name in it must be one plain path segment: a pointer naming '../other/..'
        is damaged, and discovery scans the run's manifests instead of following it."""
        try:
            raw = json.loads(data)
            if not isinstance(raw, dict) or "generation" not in raw:
                raise ValueError("not a pointer object")
            best = raw.get("best")
            ptr = cls(
                generation=checked_count(raw["generation"], "generation"),
                checkpoint=checked_name(raw.get("checkpoint"), "checkpoint", optional=True),
                step=checked_count(raw.get("step"), "step", optional=True),
                attempt=checked_count(raw.get("attempt") or 0, "attempt"),
                history=tuple(checked_name(h, "history[]") for h in
                              checked_type(raw.get("history") or [], list, "history")),
                best=Best(checked_name(best.get("checkpoint"), "best.checkpoint"),
                          checked_type(best.get("score"), (int, float), "best.score", optional=True))
                if isinstance(best, dict) else None,
                owner=checked_type(raw.get("owner"), str, "owner", optional=True),
                updated_at=checked_type(raw.get("updated_at"), (int, float), "updated_at",
                                  optional=True),
                fenced_through=checked_count(raw.get("fenced_through") or 0, "fenced_through"),
            )
        except (ValueError, TypeError, KeyError, RecursionError) as e:
            raise CheckpointError(f"{where} is unreadable ({e})") from e
        return ptr
