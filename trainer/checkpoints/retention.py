"""Retention: keep the last K committed checkpoints and the best one; delete the rest, and
the partial checkpoints that older, dead attempts left behind.

Only checkpoints in the pointer's history are counted and deleted: a claim keeps that
history to the line the live attempt continues, without names that failed verification.
A committed checkpoint the history does not name (detached by a walk-back or an explicit
resume, or a save that lost the pointer race) is left in place: retention never deletes
what it has not accounted for. Never the one the pointer names, nor the one the live
attempt descends from.
"""

from __future__ import annotations

from .layout import RunLayout, committed, list_names
from .manifest import MANIFEST, parse_checkpoint_name
from .pointer import Pointer


def apply_retention(layout: RunLayout, ptr: Pointer, parent: str | None, keep_last: int,
                    keep_best: bool, current_attempt: int, retired: set[str]) -> list[str]:
    """Delete the run's committed checkpoints beyond the newest `keep_last` of `ptr`'s
    history (and its best one), and partials of attempts before `current_attempt`; return
    the names deleted. `parent`, the checkpoint the live attempt descends from, is kept.

    `retired` gains the names of `ptr`'s history that are gone (removed now or before), for
    the next pointer move to drop. It is updated as deletions happen, so that a store
    failing halfway still leaves a record of what is already gone."""
    done = set(committed(layout))
    good = [n for n in ptr.timeline if n in done]
    retired.update(n for n in ptr.timeline if n not in done)
    keep = {ptr.checkpoint, parent, *good[: max(keep_last, 1)]}
    if keep_best and ptr.best:
        keep.add(ptr.best.checkpoint)
    deleted = []
    for name in good:
        if name not in keep:
            delete_checkpoint(layout, name)
            retired.add(name)
            deleted.append(name)
    accounted = set(ptr.timeline)
    for name in list_names(layout):
        if name in done or name in accounted:
            continue
        parsed = parse_checkpoint_name(name)
        if parsed is None or parsed[1] >= current_attempt:
            continue  # possibly a save in flight
        if delete_checkpoint(layout, name, only_partial=True):
            deleted.append(name)
    return deleted


def delete_checkpoint(layout: RunLayout, name: str, only_partial: bool = False) -> bool:
    """Delete checkpoint `name`, manifest first; with `only_partial`, only if it has none.
    Returns whether it deleted."""
    keys = layout.store.list(layout.key(name))
    manifest = layout.key(name, MANIFEST)
    if only_partial and manifest in keys:
        return False  # committed since it was listed: not a partial any more
    # Manifest first: from that moment the checkpoint no longer exists for readers.
    if manifest in keys:
        layout.store.delete(manifest)
    for k in keys:
        if k != manifest:
            layout.store.delete(k)
    return True
