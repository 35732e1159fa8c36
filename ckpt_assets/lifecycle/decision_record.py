"""The one decision about an ended attempt, created once in the checkpoint store.

The store already gives create-once writes (S3 `IfNoneMatch="*"`, a local `link()`), so
the decision about a failed Dagster run is an object at `DECISIONS/<run>/<dagster run
id>.json` that exactly one writer creates: a failure sensor, the reconciler, whoever comes
first; every later writer reads the winner's and acts on it. Nothing waits for Dagster's
own rewrites of the run's record: the failed run's `ckpt/decision*` tags are a mirror for
people and for the reconciler's queries, written by the creator and put back by whoever
finds them missing (a concurrent rewrite of the run's record can drop a tag write).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from ckpt_assets.base.clock import iso
from ckpt_assets.base.registration import validate_partition_key
from ckpt_assets.base.tags import (
    TAG_DECIDED_AT,
    TAG_DECISION,
    TAG_DECISION_REASON,
    TAG_FAILURE_CLASS,
    TAG_FAILURE_KIND,
    TAG_NEXT_BUDGET,
    TAG_RESUME_AT,
)
from trainer.base.errors import AlreadyExistsError, StorageError
from trainer.storage import ObjectStore

DECISIONS_PREFIX = "DECISIONS"


@dataclass(frozen=True)
class DecisionRecord:
    failed_run_id: str
    training_run: str
    resume: bool
    kind: str  # the policy's class (`trainer.base.outcomes.Kind`)
    failure_class: str  # the attempt's outcome (`trainer.base.outcomes.Outcome`)
    reason: str
    decided_at: float
    resume_at: float | None  # only for a resume after a back-off
    next_budget: str  # what its resume carries (`policy.Budget.to_tag`)
    attempt: int
    last_committed_step: int | None

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> DecisionRecord:
        raw = json.loads(data)
        return cls(**{f.name: raw.get(f.name) for f in fields(cls)})


def decision_key(training_run: str, failed_run_id: str) -> str:
    return f"{DECISIONS_PREFIX}/{validate_partition_key(training_run)}/{failed_run_id}.json"


def read_decision(store: ObjectStore, training_run: str,
                  failed_run_id: str) -> DecisionRecord | None:
    key = decision_key(training_run, failed_run_id)
    if not store.exists(key):
        return None
    return DecisionRecord.from_json(store.read_bytes(key))


def create_once(store: ObjectStore, rec: DecisionRecord) -> tuple[DecisionRecord, bool]:
    """(the decision that holds, whether this call made it): `rec` if no decision about
    its run existed, else the one a concurrent writer created first."""
    key = decision_key(rec.training_run, rec.failed_run_id)
    try:
        store.put_new(key, rec.to_json())
        return rec, True
    except AlreadyExistsError:
        winner = read_decision(store, rec.training_run, rec.failed_run_id)
        if winner is None:  # created and gone again: nothing deletes decisions
            raise StorageError(f"{store.uri_for(key)} was created by another writer and "
                               "cannot be read; check the store") from None
        return winner, False


def mirror_tags(rec: DecisionRecord) -> dict[str, str]:
    """The decision as the failed run's tags: what people, `list` and the reconciler's
    queries read."""
    return {TAG_DECISION: "resume" if rec.resume else "stop",
            TAG_DECISION_REASON: rec.reason[:400], TAG_FAILURE_KIND: rec.kind,
            TAG_FAILURE_CLASS: rec.failure_class, TAG_DECIDED_AT: iso(rec.decided_at),
            TAG_NEXT_BUDGET: rec.next_budget,
            **({TAG_RESUME_AT: iso(rec.resume_at)} if rec.resume_at is not None else {})}
