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
the others get DagsterRunAlreadyExists and report the run that won (the pattern Dagster
itself uses for runs several processes may register, `register_managed_run`). A launcher
that reads after the winner's run exists finds it active and creates nothing; one whose
reads straddle its creation derived its id before it and finds it active after. Chaining on
the newest run rather than counting the runs keeps ids unique when runs are deleted.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import dagster as dg
from dagster._core.errors import DagsterRunAlreadyExists

from ckpt_assets.defs.jobs import train_job
from ckpt_assets.run_queries import newest_training_run
from ckpt_assets.stop import active_runs
from ckpt_assets.tags import PARTITION_TAG

if TYPE_CHECKING:
    from dagster._core.remote_origin import CodeLocationOrigin
    from dagster._core.remote_representation.code_location import CodeLocation
    from dagster._core.workspace.context import BaseWorkspaceRequestContext

WORKSPACE_FILE = Path(__file__).resolve().parents[1] / "workspace.yaml"
# The uuid5 namespace of launch run ids. Never change it: launchers of two versions would
# derive different ids for the same run and both create one.
LAUNCH_ID_NAMESPACE = uuid.UUID("5f0c8e52-6a7e-4d0b-9a51-3c2f9d7b1e44")


class LaunchError(Exception):
    """The code location could not be loaded, or the run could not be created."""


@dataclass(frozen=True)
class LaunchPlan:
    """What a launcher read from the instance: the id of the run it would create, or the
    active run that makes a launch unnecessary."""

    partition: str
    run_id: str
    active: dg.DagsterRun | None


@dataclass(frozen=True)
class Launch:
    run: dg.DagsterRun
    created: bool  # False: the run was active already, or a concurrent launch created it


@dataclass(frozen=True)
class TrainingLocation:
    workspace: BaseWorkspaceRequestContext
    location: CodeLocation
    origin: CodeLocationOrigin  # workspace.yaml's entry: what the run records


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
                        workspace_file: Path = WORKSPACE_FILE) -> Launch:
    """Queue a train_job run for `partition` unless it has an active one (`force`: even
    then). Exactly one of several concurrent calls creates the run; each returns it."""
    plan = plan_launch(instance, partition, force=force)
    if plan.active is not None:  # no need to load the code location
        return Launch(plan.active, created=False)
    with open_training_location(instance, workspace_file) as loc:
        # Read again now that the location is loaded: a run queued meanwhile (a resume the
        # sensors launched, a launch that finished first) is seen rather than raced.
        return submit(instance, loc, plan_launch(instance, partition, force=force), tags)


def submit(instance: dg.DagsterInstance, loc: TrainingLocation, plan: LaunchPlan,
           tags: Mapping[str, str] | None = None) -> Launch:
    """Create the planned run and hand it to the run coordinator; if another launch created
    it first, return that one."""
    if plan.active is not None:
        return Launch(plan.active, created=False)
    try:
        run = create_training_run(instance, loc, plan.run_id,
                                  {**(tags or {}), PARTITION_TAG: plan.partition})
    except DagsterRunAlreadyExists:
        winner = instance.get_run_by_id(plan.run_id)
        if winner is None:  # deleted in between: nothing sensible to report but the failure
            raise LaunchError(f"run {plan.run_id} was created by another launch and deleted "
                              "at once; launch again") from None
        return Launch(winner, created=False)
    try:
        return Launch(instance.submit_run(run.run_id, loc.workspace), created=True)
    except Exception as e:  # the run coordinator's own; the instance marked the run failed
        raise LaunchError(f"Dagster run {run.run_id} was created but the run coordinator "
                          f"refused it (the run is marked failed; its log says why): {e}") from e


@contextmanager
def open_training_location(instance: dg.DagsterInstance,
                           workspace_file: Path = WORKSPACE_FILE) -> Iterator[TrainingLocation]:
    """workspace.yaml's (only) code location, loaded in-process when the instance queues
    runs (the queue needs no code server), else served as `dagster job launch` serves it."""
    from dagster._core.remote_origin import InProcessCodeLocationOrigin
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load import location_origins_from_yaml_paths
    from dagster._core.workspace.load_target import (
        InProcessWorkspaceLoadTarget,
        WorkspaceFileTarget,
    )

    origins = location_origins_from_yaml_paths([str(workspace_file)])
    if len(origins) != 1:
        raise LaunchError(f"{workspace_file} must name exactly one code location, not "
                          f"{len(origins)}")
    origin = origins[0]
    if isinstance(instance.run_coordinator, dg.QueuedRunCoordinator):
        target = InProcessWorkspaceLoadTarget(InProcessCodeLocationOrigin(
            origin.loadable_target_origin, location_name=origin.location_name))
    else:
        target = WorkspaceFileTarget(paths=[str(workspace_file)])
    with WorkspaceProcessContext(instance, target) as process:
        workspace = process.create_request_context()
        try:
            location = workspace.get_code_location(origin.location_name)
        except dg.DagsterError as e:
            raise LaunchError(f"cannot load the code location {origin.location_name!r} of "
                              f"{workspace_file}: {e}") from e
        yield TrainingLocation(workspace, location, origin)


def create_training_run(instance: dg.DagsterInstance, loc: TrainingLocation, run_id: str,
                        tags: Mapping[str, str]) -> dg.DagsterRun:
    """The run `dagster job launch -w workspace.yaml -j train_job --tags ... --run-id ...`
    creates (dagster._cli.job._create_run): the same snapshots, plan, tags and origins.
    Raises DagsterRunAlreadyExists if `run_id` exists."""
    from dagster._core.definitions.selector import JobSubsetSelector
    from dagster._core.remote_origin import RemoteJobOrigin, RemoteRepositoryOrigin
    from dagster._utils.tags import normalize_tags

    location = loc.location
    repos = list(location.get_repositories().values())
    if len(repos) != 1:
        raise LaunchError(f"code location {location.name!r} holds {len(repos)} repositories; "
                          "expected the one of ckpt_assets.definitions:defs")
    repo = repos[0]
    job = location.get_job(JobSubsetSelector(location_name=location.name,
                                             repository_name=repo.name,
                                             job_name=train_job.name, op_selection=None))
    plan = _execution_plan(instance, location, repo.name, job)
    return instance.create_run(
        job_name=job.name, run_id=run_id, run_config={},
        resolved_op_selection=job.resolved_op_selection,
        step_keys_to_execute=plan.step_keys_to_execute, op_selection=None, status=None,
        root_run_id=None, parent_run_id=None, tags=normalize_tags({**job.tags, **tags}),
        job_snapshot=job.job_snapshot, execution_plan_snapshot=plan,
        parent_job_snapshot=job.parent_job_snapshot,
        remote_job_origin=RemoteJobOrigin(RemoteRepositoryOrigin(loc.origin, repo.name),
                                          job.name),
        job_code_origin=job.get_python_origin(), asset_selection=None,
        asset_check_selection=None, asset_graph=repo.asset_graph)


def _execution_plan(instance: dg.DagsterInstance, location: CodeLocation, repo_name: str, job):
    from dagster._core.remote_representation.code_location import InProcessCodeLocation

    if not isinstance(location, InProcessCodeLocation):
        return location.get_execution_plan(job, {}, step_keys_to_execute=None,
                                           known_state=None, instance=instance
                                           ).execution_plan_snapshot
    # What a code server computes (an in-process location's own plan leaves out the
    # repository's load data, which the run worker reads back): the same plan, the same id.
    from dagster._grpc.impl import get_external_execution_plan_snapshot
    from dagster._grpc.types import ExecutionPlanSnapshotArgs

    return get_external_execution_plan_snapshot(
        location._get_repo_def(repo_name), job.name,  # noqa: SLF001
        ExecutionPlanSnapshotArgs(
            job_origin=job.get_remote_origin(), op_selection=job.op_selection or [],
            run_config={}, step_keys_to_execute=None,
            job_snapshot_id=job.identifying_job_snapshot_id,
            instance_ref=instance.get_ref() if instance.is_persistent else None))
