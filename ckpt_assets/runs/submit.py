"""Queue one `train_job` run for a training run: in this process, and once.

`ckpt-assets launch` submits through the Dagster instance itself, as `dagster job launch`
does, without its second process: the code location is loaded in-process from
workspace.yaml's entry (its module, attribute and location name are read from that file,
not repeated here), the run is created with the job's snapshot, execution plan, tags and
(empty) run config, and handed to the instance's run coordinator: the queue, which the
daemon of `dagster dev` or `dagster-daemon run` dequeues as before. The run records
workspace.yaml's origin of the `ckpt_assets` location, exactly as a run queued through
`dagster job launch -w workspace.yaml` does, so any daemon that loaded the location by that
name launches it. Only an instance whose run coordinator launches at once (not the queue)
needs the location served by a code server: then the workspace is loaded from
workspace.yaml as `dagster job launch` loads it.

Once: concurrent launches of one training run create one Dagster run. A launch reads the
partition's newest training run and derives the id of the run it creates from it
(`launch_run_id`): every launcher that read the same state derives the same id, and the
run storage's unique run id (SQLite and PostgreSQL alike) lets exactly one of them add it;
the others fail to add it and report the run that won (the pattern Dagster
itself uses for runs several processes may register, `register_managed_run`). A launcher
that reads after the winner's run exists finds it active and creates nothing; one whose
reads straddle its creation derived its id before it and finds it active after. Chaining on
the newest run rather than counting the runs keeps ids unique when runs are deleted.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import dagster as dg

from ckpt_assets.base.dagster_private import (
    SubmitError,
    TrainingLocation,
    create_training_run,
    open_training_location,
)
from ckpt_assets.base.names import WORKSPACE_FILE
from ckpt_assets.base.queries import active_runs, newest_training_run
from ckpt_assets.base.tags import PARTITION_TAG

# The uuid5 namespace of launch run ids. Never change it: launchers of two versions would
# derive different ids for the same run and both create one.
LAUNCH_ID_NAMESPACE = uuid.UUID("5f0c8e52-6a7e-4d0b-9a51-3c2f9d7b1e44")


@dataclass(frozen=True)
class LaunchPlan:
    """What a launcher read from the instance: the id of the run it would create, or the
    active run that makes a launch unnecessary."""

    partition: str
    run_id: str
    active: dg.DagsterRun | None


@dataclass(frozen=True)
class Submission:
    run: dg.DagsterRun
    created: bool  # False: the run was active already, or a concurrent launch created it


def launch_run_id(partition: str, after_run_id: str | None) -> str:
    """The id of the run a launch creates when `after_run_id` is the partition's newest
    training run (None: it has none)."""
    return str(uuid.uuid5(LAUNCH_ID_NAMESPACE, f"{partition}\n{after_run_id or ''}"))


def plan_launch(instance: dg.DagsterInstance, partition: str, *, force: bool) -> LaunchPlan:
    # The newest run first, the active ones second: a rival's run created between the two
    # reads is then seen active. Read the other way round, it was missed as active but read
    # as the newest, and this launch chained a second run onto it.
    newest = newest_training_run(instance, partition)
    active = [] if force else active_runs(instance, partition)
    return LaunchPlan(partition, launch_run_id(partition, newest.run_id if newest else None),
                      active[0] if active else None)


def launch_training_run(instance: dg.DagsterInstance, partition: str,
                        tags: Mapping[str, str] | None = None, *, force: bool = False,
                        workspace_file: Path = WORKSPACE_FILE) -> Submission:
    """Queue a train_job run for `partition` unless it has an active one (`force`: even
    then). Exactly one of several concurrent calls creates the run; each returns it."""
    plan = plan_launch(instance, partition, force=force)
    if plan.active is not None:  # no need to load the code location
        return Submission(plan.active, created=False)
    with open_training_location(instance, workspace_file) as loc:
        # Read again now that the location is loaded: a run queued meanwhile (a resume the
        # sensors launched, a launch that finished first) is seen rather than raced.
        return submit(instance, loc, plan_launch(instance, partition, force=force), tags)


def submit(instance: dg.DagsterInstance, loc: TrainingLocation, plan: LaunchPlan,
           tags: Mapping[str, str] | None = None) -> Submission:
    """Create the planned run and hand it to the run coordinator; if another launch created
    it first, return that one."""
    if plan.active is not None:
        return Submission(plan.active, created=False)
    try:
        run = create_training_run(instance, loc, plan.run_id,
                                  {**(tags or {}), PARTITION_TAG: plan.partition})
    except dg.DagsterError as e:  # the run storage's DagsterRunAlreadyExists, not exported
        winner = instance.get_run_by_id(plan.run_id)
        if winner is None:  # another failure, or the winner deleted in between
            raise SubmitError(f"run {plan.run_id} could not be created ({e}); launch "
                              "again") from e
        return Submission(winner, created=False)
    try:
        return Submission(instance.submit_run(run.run_id, loc.workspace), created=True)
    except Exception as e:  # the run coordinator's own; the instance marked the run failed
        raise SubmitError(f"Dagster run {run.run_id} was created but the run coordinator "
                          f"refused it (the run is marked failed; its log says why): {e}") from e
