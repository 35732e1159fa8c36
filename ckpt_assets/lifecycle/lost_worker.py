"""An attempt whose run worker died without recording how its trainer exited.

Seeing it is a read (`lost_worker`: the run's recorded processes say its worker ran on this
machine and is gone), done by anyone: `list`, `lineage`, the state check. Ending it is an
event with owners (`end_lost_attempt`): the reconciler's sweep, and a launch by hand of the
same training run (`ckpt-assets run`, `launch`, the `new_training_run` job), which must
chain onto it as its resume would. The run is failed (the failure sensors then decide) and
what its attempt left running is asked to stop (the trainer commits and exits 143).
"""

from __future__ import annotations

import logging

import dagster as dg

from ckpt_assets.base.process_group import AttemptProcesses
from ckpt_assets.base.tags import TAG_WORKER_LOST

# A run whose worker can die unseen: one that runs, and one that is being terminated (a stop
# or a terminate after its worker died waits on a worker that will never answer).
LIVE = (dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING)


def lost_worker(run: dg.DagsterRun) -> AttemptProcesses | None:
    """`run`'s processes if it is STARTED or CANCELING and its run worker is known dead (it
    ran on this machine and its process is gone); None otherwise (a worker elsewhere is the
    heartbeat's to judge, or run monitoring's cancel timeout's)."""
    if run.status not in LIVE:
        return None
    return died(run)


def died(run: dg.DagsterRun) -> AttemptProcesses | None:
    """`run`'s processes if its run worker is known to have died before it ended its attempt
    (whatever the run's status now), else None."""
    procs = AttemptProcesses.of_run(run)
    if procs is None or procs.ended or not procs.worker_gone():
        return None
    return procs


def lost_words(procs: AttemptProcesses) -> str:
    return (f"its run worker (pid {procs.worker.pid}) is gone: the attempt ended without "
            f"recording how its training process exited (its output: {procs.output})")


def end_lost_attempt(instance: dg.DagsterInstance, run: dg.DagsterRun) -> dg.DagsterRun:
    """`run` ended if its worker is known dead (what its attempt left running asked to stop),
    else `run` unchanged: failed as `worker_lost`, or canceled if it was being terminated
    (at once, not after run monitoring's cancel timeout: nothing is left to wait for)."""
    procs = lost_worker(run)
    if procs is None:
        return run
    msg = lost_words(procs)
    instance.add_run_tags(run.run_id, {TAG_WORKER_LOST: msg})
    if run.status == dg.DagsterRunStatus.CANCELING:
        instance.report_run_canceled(run, msg)
    else:
        instance.report_run_failed(run, msg)
    procs.stop(0.0, logging.getLogger(__name__), wait=False)
    return instance.get_run_by_id(run.run_id) or run
