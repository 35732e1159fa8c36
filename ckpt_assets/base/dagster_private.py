"""Everything of Dagster's private API that ckpt-assets uses, in one module.

Only what Dagster 1.13 offers no public API for (each import says why); keeping them here
means a Dagster upgrade that moves one changes this file only (tests/project/test_layout.py
holds every other module to the public API):

* engine events whose metadata (a run link) the UI renders (`EngineEventData`);
* interrupts captured as `dagster asset materialize` captures them (`capture_interrupts`);
* a `train_job` run created and submitted in-process as `dagster job launch -w
  workspace.yaml` creates it (`ckpt_assets.runs.submit`): the workspace's code location,
  the job's snapshots and execution plan, the run's origins.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dagster as dg

# Metadata on an event in a run's log from outside its steps (a decision, a resume's link):
# the public instance method takes it only as this record.
from dagster._core.events import EngineEventData

# A stop noted rather than raised, as Dagster's own run worker and CLI note it: the flag is
# Dagster's (its step boundaries raise it), so a handler of our own would not be seen there.
from dagster._utils.interrupts import (
    capture_interrupts,
    check_captured_interrupt,
    pop_captured_interrupt,
)

from ckpt_assets.base.names import TRAIN_JOB, WORKSPACE_FILE

if TYPE_CHECKING:  # what open_training_location yields (below: why it is private)
    from dagster._core.remote_origin import CodeLocationOrigin
    from dagster._core.remote_representation.code_location import CodeLocation
    from dagster._core.workspace.context import BaseWorkspaceRequestContext

__all__ = ["capture_interrupts", "check_captured_interrupt", "pop_captured_interrupt",
           "report_engine_event", "TrainingLocation", "open_training_location",
           "create_training_run", "SubmitError"]


class SubmitError(Exception):
    """The code location could not be loaded, or the run could not be created."""


def report_engine_event(instance: dg.DagsterInstance, run: dg.DagsterRun, words: str,
                        metadata: dict[str, Any]) -> None:
    instance.report_engine_event(words, dagster_run=run,
                                 engine_event_data=EngineEventData(metadata=metadata))


@dataclass(frozen=True)
class TrainingLocation:
    workspace: BaseWorkspaceRequestContext
    location: CodeLocation
    origin: CodeLocationOrigin  # workspace.yaml's entry: what the run records
    in_process: bool  # loaded in this process (the run queue's case), not by a code server


@contextmanager
def open_training_location(instance: dg.DagsterInstance,
                           workspace_file: Path = WORKSPACE_FILE) -> Iterator[TrainingLocation]:
    """workspace.yaml's (only) code location, loaded in-process when the instance queues
    runs (the queue needs no code server), else served as `dagster job launch` serves it."""
    # Public paths queue a run only from another process (`dagster job launch`, about 3 s)
    # or through a running webserver (GraphQL); no public Python API loads a workspace.
    from dagster._core.remote_origin import InProcessCodeLocationOrigin
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load import location_origins_from_yaml_paths
    from dagster._core.workspace.load_target import (
        InProcessWorkspaceLoadTarget,
        WorkspaceFileTarget,
    )

    origins = location_origins_from_yaml_paths([str(workspace_file)])
    if len(origins) != 1:
        raise SubmitError(f"{workspace_file} must name exactly one code location, not "
                          f"{len(origins)}")
    origin = origins[0]
    in_process = isinstance(instance.run_coordinator, dg.QueuedRunCoordinator)
    if in_process:
        target = InProcessWorkspaceLoadTarget(InProcessCodeLocationOrigin(
            origin.loadable_target_origin, location_name=origin.location_name))
    else:
        target = WorkspaceFileTarget(paths=[str(workspace_file)])
    with WorkspaceProcessContext(instance, target) as process:
        workspace = process.create_request_context()
        try:
            location = workspace.get_code_location(origin.location_name)
        except dg.DagsterError as e:
            raise SubmitError(f"cannot load the code location {origin.location_name!r} of "
                              f"{workspace_file}: {e}") from e
        yield TrainingLocation(workspace, location, origin, in_process)


def create_training_run(instance: dg.DagsterInstance, loc: TrainingLocation, run_id: str,
                        tags: Mapping[str, str]) -> dg.DagsterRun:
    """The run `dagster job launch -w workspace.yaml -j train_job --tags ... --run-id ...`
    creates (dagster._cli.job._create_run): the same snapshots, plan, tags and origins.
    Raises a DagsterError if `run_id` exists."""
    # The origin the run records is workspace.yaml's, not the in-process location's: the
    # public launch paths (the CLI, GraphQL) build it inside Dagster, with no Python API.
    from dagster._core.remote_origin import RemoteJobOrigin, RemoteRepositoryOrigin

    location = loc.location
    repos = list(location.get_repositories().values())
    if len(repos) != 1:
        raise SubmitError(f"code location {location.name!r} holds {len(repos)} repositories; "
                          "expected the one of ckpt_assets.definitions:defs")
    repo = repos[0]
    job = repo.get_full_job(TRAIN_JOB)
    plan = _execution_plan(instance, loc, repo.name, job)
    return instance.create_run(
        job_name=job.name, run_id=run_id, run_config={},
        resolved_op_selection=job.resolved_op_selection,
        step_keys_to_execute=plan.step_keys_to_execute, op_selection=None, status=None,
        root_run_id=None, parent_run_id=None, tags={**job.tags, **tags},
        job_snapshot=job.job_snapshot, execution_plan_snapshot=plan,
        parent_job_snapshot=job.parent_job_snapshot,
        remote_job_origin=RemoteJobOrigin(RemoteRepositoryOrigin(loc.origin, repo.name),
                                          job.name),
        job_code_origin=job.get_python_origin(), asset_selection=None,
        asset_check_selection=None, asset_graph=repo.asset_graph)


def _execution_plan(instance: dg.DagsterInstance, loc: TrainingLocation, repo_name: str, job):
    location = loc.location
    if not loc.in_process:
        return location.get_execution_plan(job, {}, step_keys_to_execute=None,
                                           known_state=None, instance=instance
                                           ).execution_plan_snapshot
    # What a code server computes (an in-process location's own plan leaves out the
    # repository's load data, which the run worker reads back): the same plan, the same id.
    # Only a code server's gRPC handler computes it: no public API does.
    from dagster._grpc.impl import get_external_execution_plan_snapshot
    from dagster._grpc.types import ExecutionPlanSnapshotArgs

    return get_external_execution_plan_snapshot(
        location._get_repo_def(repo_name), job.name,  # noqa: SLF001
        ExecutionPlanSnapshotArgs(
            job_origin=job.get_remote_origin(), op_selection=job.op_selection or [],
            run_config={}, step_keys_to_execute=None,
            job_snapshot_id=job.identifying_job_snapshot_id,
            instance_ref=instance.get_ref() if instance.is_persistent else None))

