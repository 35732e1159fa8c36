"""One typed view of a training run's Dagster run: every `ckpt/` tag parsed once, here.

Everything that reads a run's state (the lifecycle, `list`, `lineage`, the sensors) reads
these fields instead of the raw tags, so a tag's spelling and its default live in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import dagster as dg

from ckpt_assets.base.clock import parse_time
from ckpt_assets.base.tags import (
    PARTITION_TAG,
    TAG_ATTEMPT,
    TAG_ATTEMPT_STARTED_AT,
    TAG_BUDGET,
    TAG_DECIDED_AT,
    TAG_DECISION,
    TAG_DECISION_REASON,
    TAG_FAILURE_CLASS,
    TAG_FAILURE_KIND,
    TAG_HEARTBEAT_LOST,
    TAG_INTERRUPTED,
    TAG_NEXT_BUDGET,
    TAG_NO_RESUME,
    TAG_PARENT_RUN_ID,
    TAG_RESUME_AT,
    TAG_RESUME_FROM,
    TAG_RESUMED_BY,
    TAG_ROOT_RUN_ID,
    TAG_STALLED,
    TAG_STOP_REASON,
    TAG_WORKER_LOST,
    interrupted_of,
    interrupted_tag,
    world_of,
    world_tags,
)


def attempt_number(text: str | None) -> int | None:
    """An attempt tag's number; None for a tag that is absent or not a positive number."""
    text = (text or "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


@dataclass(frozen=True)
class RunView:
    run_id: str
    partition: str
    status: dg.DagsterRunStatus
    attempt: int  # 1 for a first attempt, which carries no attempt tag
    attempt_tagged: bool  # whether the run carries its attempt number
    attempt_started_at: float | None  # set when the attempt was relaunched inside the run
    parent_run_id: str | None
    root_run_id: str  # the run itself for the first of its chain
    resume_from: str | None
    budget: str
    next_budget: str
    decision: str | None  # "resume" | "stop" once decided
    decision_reason: str
    failure_kind: str | None
    failure_class: str | None  # the decided attempt's outcome, by its one name
    decided_at: float | None
    resume_at: float | None
    resumed_by: str | None
    stop_requested: bool  # `ckpt/no_resume`: stopped for good by a user
    stop_reason: str | None
    heartbeat_lost: str | None
    stalled: str | None
    worker_lost: str | None
    world: dict[str, str]  # `distributed` keys this run's launch set (WORLD_TAGS), as given
    interrupted: dict[int, str]  # the chain's earlier attempts -> their outcomes' names

    @classmethod
    def of(cls, run: dg.DagsterRun) -> RunView:
        t = run.tags
        tagged = attempt_number(t.get(TAG_ATTEMPT))
        return cls(
            run.run_id, t.get(PARTITION_TAG, ""), run.status, tagged or 1, tagged is not None,
            parse_time(t.get(TAG_ATTEMPT_STARTED_AT)),
            t.get(TAG_PARENT_RUN_ID) or None, t.get(TAG_ROOT_RUN_ID) or run.run_id,
            t.get(TAG_RESUME_FROM) or None, t.get(TAG_BUDGET, ""), t.get(TAG_NEXT_BUDGET, ""),
            t.get(TAG_DECISION) or None, t.get(TAG_DECISION_REASON, ""),
            t.get(TAG_FAILURE_KIND) or None, t.get(TAG_FAILURE_CLASS) or None, parse_time(t.get(TAG_DECIDED_AT)),
            parse_time(t.get(TAG_RESUME_AT)), t.get(TAG_RESUMED_BY) or None,
            t.get(TAG_NO_RESUME) == "true", t.get(TAG_STOP_REASON) or None,
            t.get(TAG_HEARTBEAT_LOST) or None, t.get(TAG_STALLED) or None,
            t.get(TAG_WORKER_LOST) or None,
            world_of(t), interrupted_of(t.get(TAG_INTERRUPTED)))

    @property
    def world_tags(self) -> dict[str, str]:
        """The tags that ask for this run's world size: a resume of it carries them."""
        return world_tags(self.world)

    def next_attempt_tags(self, attempt: int, ended: tuple[int, str] | None = None
                          ) -> dict[str, str]:
        """What the run of the chain's next attempt carries, whoever launches it (the
        sensors' resume, a launch by hand): this run as its parent, the chain's root, the
        attempt's number, the world size this run was asked to train at, and the chain's
        interrupted attempts, with `ended` ((attempt, outcome): this run's) added."""
        before = interrupted_tag(self.interrupted, ended)
        return {TAG_PARENT_RUN_ID: self.run_id, TAG_ROOT_RUN_ID: self.root_run_id,
                TAG_ATTEMPT: str(attempt), **self.world_tags,
                **({TAG_INTERRUPTED: before} if before else {})}

    @property
    def ended_unsuccessfully(self) -> bool:
        return self.status in (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)
