"""An attempt whose run worker died without recording how its trainer exited, ended.

Seeing it is a read (`lifecycle.ended.lost_worker`: the run's recorded processes say its
worker ran on this machine and is gone), done by anyone: `list`, `lineage`, the state check.
Ending it is the move `run worker lost`, owned here (`end_lost_attempt`) and asked for by the
reconciler's sweep and by a launch by hand of the same training run (`ckpt-assets run`,
`launch`, the `new_training_run` job), which must chain onto it as its resume would. The run
is failed (the failure sensors then decide) and what its attempt left running is asked to
stop (the trainer commits and exits 143).
"""

from __future__ import annotations

import logging
from contextlib import suppress

import dagster as dg

from ckpt_assets.base.tags import PARTITION_TAG, TAG_WORKER_LOST
from ckpt_assets.lifecycle.ended import lost_words, lost_worker
from ckpt_assets.lifecycle.model import Event, NotAMove
from ckpt_assets.lifecycle.transition import Writes, transition


def end_lost_attempt(instance: dg.DagsterInstance, run: dg.DagsterRun) -> dg.DagsterRun:
    """`run` failed as `worker_lost` if its worker is known dead (what its attempt left
    running asked to stop), else `run` unchanged."""
    procs = lost_worker(run)
    if procs is None:
        return run
    msg = lost_words(procs)

    def end(w: Writes) -> None:
        w.tag(run.run_id, {TAG_WORKER_LOST: msg})
        w.fail(run, msg)
        procs.stop(0.0, logging.getLogger(__name__), wait=False)

    with suppress(NotAMove):  # e.g. stopped for good meanwhile: the stop ends it
        transition(instance, run.tags[PARTITION_TAG], Event.WORKER_LOST, end, run=run)
    return instance.get_run_by_id(run.run_id) or run
