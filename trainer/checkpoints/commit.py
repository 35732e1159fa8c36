"""The commit protocol's steps, as functions of a run's layout: a pending checkpoint's files,
its manifest (written last: it makes the checkpoint exist), the pointer's conditional move,
and what the pointer's history says of a line of checkpoints.

`trainer.checkpoints.repo.CheckpointRepo` is the one writer that calls them in order;
the orchestrator's asset versions (`ckpt_assets.records.asset_versions`) write through the
same steps, so both sides share one protocol.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..base.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    PointerConflictError,
)
from ..storage import HashingWriter, WrittenObject
from . import verification
from .layout import RunLayout, list_names
from .manifest import (
    MANIFEST,
    Manifest,
    file_entry,
    parse_checkpoint_name,
)
from .pointer import Best, Pointer

log = logging.getLogger("trainer.checkpoint")

# Names latest.json carries besides its current one. Retention removes deleted names from
# it, so in practice it holds about keep_last names; the bound only caps a damaged pointer.
POINTER_HISTORY = 256
CLAIM_TRIES = 20


@dataclass
class Pending:
    """A checkpoint being written: files land under a name no one else uses."""

    name: str
    step: int
    attempt: int
    written: dict[str, WrittenObject] = field(default_factory=dict)


# -- writing, as functions over a layout --------------------------------------------------

@contextmanager
def write_file(layout: RunLayout, pending: Pending, filename: str) -> Iterator[HashingWriter]:
    """A create-once stream for `filename` of the pending checkpoint."""
    key = layout.key(pending.name, filename)
    with layout.store.create(key) as w:
        yield w
    pending.written[filename] = w.result(key)


def write_manifest(layout: RunLayout, pending: Pending, parent: str | None,
                   meta: dict[str, Any]) -> Manifest:
    """MANIFEST.json, create-once and last inside the checkpoint: from now on it exists."""
    manifest = Manifest(
        name=pending.name,
        step=pending.step,
        attempt=pending.attempt,
        files={n: file_entry(w) for n, w in pending.written.items()},
        parent=parent,
        created_at=time.time(),
        meta=meta,
        experiment=layout.experiment,
        run=layout.run,
    )
    layout.store.put_new(layout.key(pending.name, MANIFEST), manifest.to_json())
    return manifest


def committed_pointer(old: Pointer | None, pending: Pending, meta: dict[str, Any],
                      retired: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """The pointer's changes once `pending` is committed: it is current, the previous ones
    (without `retired` names) its history, and it is the best one when `meta` says so."""
    old = old or Pointer()
    best = old.best
    if meta.get("is_best"):
        score = meta.get("best_score")
        best = Best(pending.name, score if isinstance(score, int | float) else None)
    history = [n for n in old.timeline if n not in retired]
    return {"checkpoint": pending.name, "step": pending.step, "attempt": pending.attempt,
            "history": tuple(history[:POINTER_HISTORY]), "best": best}


def move_pointer(layout: RunLayout, old: Pointer | None, token: str | None, owner: str,
                 **changes: Any) -> tuple[Pointer, str]:
    """Write `old` with `changes` as the next generation, only if the pointer is still at
    version `token`. Returns the new pointer and its token; PointerConflictError if another
    writer moved it."""
    old = old or Pointer()
    new = dataclasses.replace(old, **changes, generation=old.generation + 1,
                              owner=owner, updated_at=time.time())
    try:
        token = layout.store.write_if(layout.pointer_key, new.to_json(), token)
    except PointerConflictError as e:
        raise PointerConflictError(
            f"another attempt took over run {layout.prefix} ({e}); this attempt stops "
            "writing so that two attempts never advance one run"
        ) from e
    return new, token


# -- the claim: which history an attempt continues ----------------------------------------

def claimed_timeline(layout: RunLayout, old: Pointer | None, parent: str | None,
                     bad: set[str]) -> tuple[list[str], Best | None]:
    """The history an attempt continuing from `parent` claims, newest first, and the best
    checkpoint it keeps; names in `bad` (failed verification) are left out."""
    if old is not None:
        timeline = [n for n in old.timeline if n not in bad]
        if parent is None:
            kept = timeline
        elif parent in timeline:
            kept = timeline[timeline.index(parent):]
        else:
            kept = lineage(layout, parent, bad)
    else:
        timeline = []
        kept = lineage(layout, parent, bad) if parent else []
    detached = [n for n in timeline if n not in kept]
    if detached:
        log.warning(
            "checkpoints %s are newer than %s, which this attempt continues from; they "
            "leave the run's history and retention keeps them. Delete them by hand once "
            "they are not needed.", ", ".join(detached), parent)
    best = old.best if old else None
    if best and (best.checkpoint in bad or best.checkpoint in detached):
        best = None
    return kept[:POINTER_HISTORY + 1], best


def lineage(layout: RunLayout, name: str, bad: set[str]) -> list[str]:
    """`name` and its ancestors by the manifests' parent links, newest first, as far as
    readable manifests of this run reach (names in `bad` left out)."""
    chain: list[str] = []
    seen: set[str] = set()
    while name and name not in seen and len(chain) <= POINTER_HISTORY:
        seen.add(name)
        try:
            m = verification.read_manifest(layout, name)
        except verification.UNUSABLE:
            break
        if name not in bad:
            chain.append(name)
        name = m.parent
    return chain


def step_of(layout: RunLayout, name: str | None, old: Pointer | None) -> int | None:
    if name is None:
        return None
    if old is not None and old.checkpoint == name:
        return old.step
    parsed = parse_checkpoint_name(name)
    if parsed:
        return parsed[0]
    try:
        return verification.read_manifest(layout, name).step
    except (CheckpointError, CheckpointNotFoundError):
        return None


def highest_attempt(layout: RunLayout) -> int:
    """The highest attempt number in any checkpoint name of the run (0 if none)."""
    return max((p[1] for n in list_names(layout) if (p := parse_checkpoint_name(n))),
               default=0)
