"""Every decision of the resume sensors and the reconciler, in seconds and without a daemon.

Each test builds real DagsterRun records in an ephemeral instance: a failed attempt is a
tiny `train_job` whose `model_checkpoint` step raises the same structured failure the
real asset raises; a lost run worker is a run marked failed with no step event; a stuck
run is one whose RUN_START lies in the past. The sensors are then evaluated through
Dagster's own test contexts, exactly as the daemon would call them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.events import DagsterEvent, DagsterEventType
from dagster._core.events.log import EventLogEntry
from dagster._core.test_utils import create_run_for_test

from ckpt_assets.base import events
from ckpt_assets.base.attempt_processes import AttemptProcesses
from ckpt_assets.base.clock import iso, parse_time
from ckpt_assets.base.end import AttemptEnd
from ckpt_assets.base.queries import is_training_run
from ckpt_assets.base.tags import (
    PARTITION_TAG,
    TAG_ATTEMPT,
    TAG_ATTEMPT_STARTED_AT,
    TAG_BUDGET,
    TAG_DECIDED_AT,
    TAG_DECISION,
    TAG_DECISION_REASON,
    TAG_FAILURE_KIND,
    TAG_HEARTBEAT_LOST,
    TAG_NO_RESUME,
    TAG_PARENT_RUN_ID,
    TAG_PROCESSES,
    TAG_RESUME_AT,
    TAG_RESUME_FROM,
    TAG_ROOT_RUN_ID,
    TAG_STALLED,
    TAG_WORKER_LOST,
)
from ckpt_assets.defs.resources import CheckpointStore
from ckpt_assets.defs.sensors import (
    reconcile_training_runs,
    resume_failed_training,
    resume_terminated_training,
)
from ckpt_assets.lifecycle.decision_record import decision_key, read_decision
from ckpt_assets.lifecycle.policy import Budget
from ckpt_assets.lifecycle.settings import ResumeSettings, Setting
from tests import dagster_runs
from tests.dagster_fixtures import NO_MLFLOW
from trainer.base.errors import PointerConflictError, StorageError
from trainer.base.outcomes import Kind, Outcome
from trainer.base.process_id import ProcessId
from trainer.checkpoints.records import Beat
from trainer.checkpoints.repo import CheckpointRepo

KEY = "run-a"


@pytest.fixture(autouse=True)
def timeouts(monkeypatch):
    """The shipped defaults, whatever the environment of the test process says."""
    for name in Setting:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def instance():
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    """The run's store with its config registered and step 20 committed by attempt 1."""
    return dagster_runs.store_with_a_checkpoint(tmp_path, KEY, 100)


def _repo(store: CheckpointStore) -> CheckpointRepo:
    return CheckpointRepo(store.open(), "default", KEY)


def beat(store: CheckpointStore, age_s: float) -> None:
    """The trainer's heartbeat file as it looks `age_s` seconds after its last beat."""
    repo = _repo(store)
    body = {"time": time.time() - age_s, "step": 20, "attempt": 1, "pid": 1}
    repo.store.write_overwrite(f"{repo.prefix}/heartbeat.json", json.dumps(body).encode())


# -- runs as the sensors find them ------------------------------------------------------------

def failed_run(instance, *, exit_code: int, failure_class: str, step: int | None = 20,
               attempt: int = 1, tags: dict | None = None) -> dg.DagsterRun:
    """A training run whose model_checkpoint step failed with a structured TrainingFailure."""

    @dg.op(name="model_checkpoint")
    def model_checkpoint():
        raise AttemptEnd(Outcome(failure_class), KEY, exit_code, attempt=attempt,
                         last_committed_step=step).to_dagster("attempt failed")

    @dg.job(name="train_job")
    def train_job():
        model_checkpoint()

    result = train_job.execute_in_process(
        instance=instance, raise_on_error=False, tags={PARTITION_TAG: KEY, **(tags or {})})
    assert result.dagster_run.status == dg.DagsterRunStatus.FAILURE
    return result.dagster_run


def started_run(instance, started_ago: float = 0.0, tags: dict | None = None):
    return dagster_runs.started_run(instance, KEY, started_ago, tags)


def lost_worker_run(instance, tags: dict | None = None):
    return dagster_runs.lost_worker_run(instance, KEY, tags)


def canceled_run(instance, tags: dict | None = None):
    return dagster_runs.canceled_run(instance, KEY, tags)


def launched(instance, req: dg.RunRequest) -> dg.DagsterRun:
    """What the daemon does with a RunRequest: a new run of the partition, with its tags."""
    return create_run_for_test(instance, job_name="train_job", tags={
        PARTITION_TAG: req.partition_key, "dagster/run_key": req.run_key, **req.tags})


# -- evaluating the sensors -------------------------------------------------------------------

def _end_event(instance, run: dg.DagsterRun) -> DagsterEvent:
    kinds = (DagsterEventType.RUN_FAILURE, DagsterEventType.RUN_CANCELED)
    for kind in kinds:
        recs = instance.all_logs(run.run_id, of_type=kind)
        if recs:
            return recs[-1].dagster_event
    raise AssertionError(f"run {run.run_id} has not ended")


def _evaluate(sensor, instance, run: dg.DagsterRun, store: CheckpointStore):
    """One evaluation of a run-status sensor on `run`'s end event, as the daemon makes it."""
    ctx = dg.build_run_status_sensor_context(
        sensor_name=sensor.name, dagster_event=_end_event(instance, run),
        dagster_instance=instance, dagster_run=instance.get_run_by_id(run.run_id),
        resources={"checkpoint_store": store, **NO_MLFLOW})
    return sensor(ctx)


def _decided_then_launched(sensor, instance, run: dg.DagsterRun, store: CheckpointStore):
    """A failure sensor's evaluation of `run`'s end (it decides and launches nothing), then
    the reconciler's next tick, the one launcher of resumes: the resume it launches for
    `run`, or the failure sensor's SkipReason where it launches none."""
    decided = _evaluate(sensor, instance, run, store)
    assert isinstance(decided, dg.SkipReason), decided  # a failure sensor never launches
    resumes = [r for r in tick(instance, store) if r.run_key == f"resume-{run.run_id}"]
    return resumes[0] if resumes else decided


def on_failure(instance, run: dg.DagsterRun, store: CheckpointStore):
    return _decided_then_launched(resume_failed_training, instance, run, store)


def on_cancel(instance, run: dg.DagsterRun, store: CheckpointStore):
    return _decided_then_launched(resume_terminated_training, instance, run, store)


def _reconcile(instance, store: CheckpointStore, cursor: str | None) -> list[dg.RunRequest]:
    out = reconcile_training_runs(dg.build_sensor_context(
        instance=instance, cursor=cursor, resources={"checkpoint_store": store, **NO_MLFLOW}))
    return [] if isinstance(out, dg.SkipReason) else list(out)


def tick(instance, store: CheckpointStore) -> list[dg.RunRequest]:
    """The reconciler's cheap tick (its sweep ran a moment ago): the due resumes only."""
    return _reconcile(instance, store, iso(time.time()))


def sweep(instance, store: CheckpointStore) -> list[dg.RunRequest]:
    """The reconciler's full sweep."""
    return _reconcile(instance, store, None)


def tags_of(instance, run: dg.DagsterRun) -> dict:
    return dict(instance.get_run_by_id(run.run_id).tags)


def retired(instance, run: dg.DagsterRun) -> str:
    """What the reconciler did to a silent run's trainer, as the run's own log says it."""
    kinds = (DagsterEventType.RUN_FAILURE, DagsterEventType.ENGINE_EVENT)
    return " | ".join(r.message or "" for kind in kinds
                      for r in instance.all_logs(run.run_id, of_type=kind))


def decisions(instance) -> list[dict]:
    return events.decisions(instance, KEY)


def backdate_decision(instance, run: dg.DagsterRun, seconds: float, store=None) -> None:
    """Move the decision (and a back-off's due time) `seconds` into the past: its record in
    the store (the truth) and its tags (the mirror)."""
    tags = tags_of(instance, run)
    instance.add_run_tags(run.run_id, {
        tag: iso(parse_time(tags[tag]) - seconds)
        for tag in (TAG_DECIDED_AT, TAG_RESUME_AT) if tag in tags})
    if store is not None:
        s = store.open()
        rec = read_decision(s, KEY, run.run_id)
        s.write_overwrite(decision_key(KEY, run.run_id), replace(
            rec, decided_at=rec.decided_at - seconds,
            resume_at=None if rec.resume_at is None else rec.resume_at - seconds).to_json())


def carried_budget(req: dg.RunRequest) -> dict:
    return asdict(Budget.from_tag(req.tags[TAG_BUDGET]))


# -- the code location ------------------------------------------------------------------------

def test_the_code_location_holds_the_three_sensors_and_the_training_jobs():
    from ckpt_assets.definitions import defs

    repo = defs.get_repository_def()
    assert {s.name for s in repo.sensor_defs} >= {
        "resume_failed_training", "resume_terminated_training", "reconcile_training_runs"}
    assert all(repo.has_job(j) for j in ("train_job", "train_demo", "stop_training_run"))


def test_a_run_of_the_demo_preset_is_a_training_run_the_sensors_resume():
    run = dg.DagsterRun(job_name="train_demo", run_id="r1", tags={PARTITION_TAG: "demo-1"})
    assert is_training_run(run)
    stop = dg.DagsterRun(job_name="stop_training_run", run_id="r2",
                         tags={PARTITION_TAG: "demo-1"})
    assert not is_training_run(stop)


# -- the failure sensors ----------------------------------------------------------------------

def test_a_preempted_run_is_resumed_once_tagged_with_parent_root_attempt_checkpoint_and_budget(
        instance, store):
    run = failed_run(instance, exit_code=143, failure_class="preempted")
    req = on_failure(instance, run, store)
    assert isinstance(req, dg.RunRequest)
    assert req.run_key == f"resume-{run.run_id}"
    assert req.partition_key == KEY and req.job_name == "train_job"
    assert req.tags[TAG_PARENT_RUN_ID] == run.run_id
    assert req.tags[TAG_ROOT_RUN_ID] == run.run_id  # the first attempt is its own root
    assert req.tags[TAG_ATTEMPT] == "2"
    assert req.tags[TAG_RESUME_FROM] == _repo(store).uri("step-000000020-a1")
    assert carried_budget(req) == {
        "preemptions": 1, "transient": 0, "resumed_from_step": 20, "high_step": 20,
        "failures": 1}
    tags = tags_of(instance, run)
    assert tags[TAG_DECISION] == "resume" and tags[TAG_FAILURE_KIND] == "preempted"
    (decision,) = decisions(instance)
    assert decision["failed_run_id"] == run.run_id and decision["decision"] == "resume"


def test_a_resume_of_a_resume_keeps_the_root_and_numbers_the_next_attempt(instance, store):
    run = failed_run(instance, exit_code=143, failure_class="preempted", attempt=3,
                     tags={TAG_ROOT_RUN_ID: "root-id", TAG_ATTEMPT: "3"})
    req = on_failure(instance, run, store)
    assert req.tags[TAG_ROOT_RUN_ID] == "root-id" and req.tags[TAG_ATTEMPT] == "4"


def test_a_killed_trainer_is_resumed_at_once_within_its_budget(instance, store):
    run = failed_run(instance, exit_code=-9, failure_class="killed_by_signal")
    req = on_failure(instance, run, store)
    assert isinstance(req, dg.RunRequest)
    assert tags_of(instance, run)[TAG_FAILURE_KIND] == "killed"
    # It committed step 20 before it died: progress, so it spends no budget.
    assert carried_budget(req)["transient"] == 0 and carried_budget(req)["failures"] == 1


def test_a_killed_trainer_past_its_budget_is_not_resumed(instance, store, monkeypatch):
    monkeypatch.setenv("CKPT_MAX_TRANSIENT_FAILURES", "3")
    budget = {"transient": 3, "resumed_from_step": 20, "high_step": 20, "failures": 4}
    run = failed_run(instance, exit_code=-9, failure_class="killed_by_signal",
                     tags={TAG_BUDGET: json.dumps(budget)})
    assert isinstance(on_failure(instance, run, store), dg.SkipReason)
    tags = tags_of(instance, run)
    assert tags[TAG_DECISION] == "stop" and tags[TAG_FAILURE_KIND] == "crash_loop"
    assert tags[TAG_DECISION_REASON].startswith(
        "not resumed: crash loop, 4 killed failures in a row since step 20, over the budget "
        "of 3")
    assert sweep(instance, store) == []


def test_a_lost_run_worker_counts_as_killed_and_resumes_from_the_stores_latest(instance, store):
    run = lost_worker_run(instance)
    req = on_failure(instance, run, store)
    assert tags_of(instance, run)[TAG_FAILURE_KIND] == "killed"
    assert req.tags[TAG_RESUME_FROM] == _repo(store).uri("step-000000020-a1")
    assert carried_budget(req)["resumed_from_step"] == 20


def test_a_run_whose_worker_is_gone_is_ended_decided_and_resumed_in_one_tick(instance, store):
    """Not at the next full sweep (every 15 s) nor after a failure sensor's tick: a lost run
    worker costs its run at most one tick of the reconciler."""
    # A worker on this machine that is gone: a pid above any pid_max (2**22) never runs.
    worker = dataclasses.replace(ProcessId.of(), pid=2**22 + 1)
    procs = AttemptProcesses(worker, worker, "/tmp/ckpt-lost.log")
    run = dagster_runs.started_run(instance, KEY, tags={TAG_PROCESSES: procs.to_tag()})
    (req,) = tick(instance, store)
    ended = instance.get_run_by_id(run.run_id)
    assert ended.status == dg.DagsterRunStatus.FAILURE and TAG_WORKER_LOST in ended.tags
    assert ended.tags[TAG_DECISION] == "resume"
    assert req.tags[TAG_PARENT_RUN_ID] == run.run_id
    assert req.tags[TAG_RESUME_FROM] == _repo(store).uri("step-000000020-a1")


def test_a_failure_no_failure_sensor_decided_yet_is_decided_and_resumed_by_the_next_tick(
        instance, store):
    """The failure sensors tick in the same daemon loop as the reconciler: a decision left to
    them would be launched a loop later."""
    run = failed_run(instance, exit_code=-9, failure_class="killed_by_signal")
    (req,) = tick(instance, store)
    assert tags_of(instance, run)[TAG_DECISION] == "resume"
    assert req.tags[TAG_PARENT_RUN_ID] == run.run_id


def _end_event_stored_before_its_record(instance, run: dg.DagsterRun) -> DagsterEvent:
    """A worker's RUN_FAILURE as the sensor first meets it: in the event log, the run's record
    not yet updated (Dagster stores the event, then rewrites the record)."""
    event = DagsterEvent(DagsterEventType.RUN_FAILURE.value, job_name="train_job",
                         message="run worker lost")
    instance.event_log_storage.store_event(EventLogEntry(
        error_info=None, level=logging.ERROR, user_message="", run_id=run.run_id,
        timestamp=time.time(), dagster_event=event))
    return event


def test_the_state_a_decision_records_is_that_decision_though_dagster_dropped_its_tags(
        instance, store, monkeypatch):
    """The decider writes the decision's mirror tags, then records the partition's state:
    derived from the run as decided, not read back, so Dagster's late rewrite of the ended
    run (which drops those tags until the mirror is put back) cannot make it read another."""
    run = failed_run(instance, exit_code=1, failure_class="user_code_error")
    monkeypatch.setattr(instance, "add_run_tags", lambda run_id, tags: None)  # dropped
    on_failure(instance, run, store)
    (state, _), = events.partition_events(instance, KEY, events.STATE, newest_first=True,
                                          limit=1)
    assert (state["state"], state["decision"]) == ("stopped by policy", "stop")
    assert state["detail"].startswith("not resumed: "), state["detail"]


def test_a_decision_stands_when_dagsters_late_rewrite_of_the_run_drops_its_tags(
        instance, store, monkeypatch):
    """Dagster reads the run's record, then (late, on a busy machine) writes it back whole
    with the end status: tags written between the two are dropped. The decision is its
    create-once record in the store; the reconciler puts the mirror back without deciding
    again, and nothing waits for Dagster's write."""
    run = started_run(instance)
    event = _end_event_stored_before_its_record(instance, run)
    storage, read = instance.run_storage, instance.run_storage._get_run_by_id
    late_writer = threading.Thread(target=storage.handle_run_event, args=(run.run_id, event))
    has_read, decided = threading.Event(), threading.Event()

    def read_then_stall(run_id):
        got = read(run_id)
        if threading.current_thread() is late_writer:
            has_read.set()
            assert decided.wait(60)  # read before the sensor's decision, written after it
        return got

    monkeypatch.setattr(storage, "_get_run_by_id", read_then_stall)
    late_writer.start()
    assert has_read.wait(60)
    skip = on_failure(instance, run, store)  # decided; not launched: the record says STARTED
    decided.set()
    late_writer.join()
    assert isinstance(skip, dg.SkipReason) and "launches the resume" in skip.skip_message, skip
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
    rec = read_decision(store.open(), KEY, run.run_id)
    assert (rec.resume, rec.kind) == (True, "killed")
    (req,) = sweep(instance, store)  # the reconciler's next look: the mirror back, launched
    assert req.run_key == f"resume-{run.run_id}"
    tags = tags_of(instance, run)
    assert (tags[TAG_DECISION], tags[TAG_FAILURE_KIND]) == ("resume", "killed")
    assert len(decisions(instance)) == 1  # said once, by the one that decided


def test_a_run_whose_record_does_not_say_it_ended_yet_is_decided_from_its_end_event(
        instance, store):
    run = started_run(instance)
    _end_event_stored_before_its_record(instance, run)
    skip = on_failure(instance, run, store)
    assert "decided: resumed at once" in skip.skip_message, skip
    rec = read_decision(store.open(), KEY, run.run_id)
    assert (rec.resume, rec.failure_class) == (True, "worker_lost")


@pytest.mark.parametrize("exit_code,failure_class,kind", [
    (2, "bad_input", "bad_input"),
    (1, "user_code_error", "bug"),
    (4, "diverged", "diverged"),
    (3, "checkpoint_unloadable", "checkpoint"),
    (6, "superseded", "superseded"),
    (0, Outcome.NO_CHECKPOINT.value, "no_checkpoint"),
])
def test_failures_that_a_resume_cannot_fix_stop_with_their_reason_on_the_run(
        instance, store, exit_code, failure_class, kind):
    run = failed_run(instance, exit_code=exit_code, failure_class=failure_class)
    skip = on_failure(instance, run, store)
    assert isinstance(skip, dg.SkipReason)
    tags = tags_of(instance, run)
    assert tags[TAG_DECISION] == "stop" and tags[TAG_FAILURE_KIND] == kind
    assert tags[TAG_DECISION_REASON].startswith("not resumed: ")
    assert tags[TAG_DECISION_REASON] in skip.skip_message
    (decision,) = decisions(instance)
    assert decision["decision"] == "stop" and decision["failure_kind"] == kind
    assert sweep(instance, store) == []  # and the reconciler does not overrule it


def test_a_run_failing_again_at_the_step_it_resumed_from_stops_as_a_crash_loop(
        instance, store):
    budget = {"transient": 3, "resumed_from_step": 20, "high_step": 20, "failures": 4}
    run = failed_run(instance, exit_code=-9, failure_class="killed_by_signal", attempt=3,
                     tags={TAG_BUDGET: json.dumps(budget), TAG_ATTEMPT: "3"})
    assert isinstance(on_failure(instance, run, store), dg.SkipReason)
    tags = tags_of(instance, run)
    assert tags[TAG_DECISION] == "stop" and tags[TAG_FAILURE_KIND] == "crash_loop"
    assert "crash loop" in tags[TAG_DECISION_REASON]


def test_a_failed_run_that_is_not_the_newest_of_its_partition_is_ignored(instance, store):
    older = failed_run(instance, exit_code=-9, failure_class="killed_by_signal")
    started_run(instance)  # a newer run of the same training run (a resume, a relaunch)
    skip = on_failure(instance, older, store)
    assert isinstance(skip, dg.SkipReason) and "a newer run" in skip.skip_message, skip
    assert TAG_DECISION not in tags_of(instance, older)
    assert decisions(instance) == []
    assert sweep(instance, store) == []


def test_a_run_terminated_from_dagster_is_a_preemption_and_resumes(instance, store):
    run = canceled_run(instance)
    req = on_cancel(instance, run, store)
    assert isinstance(req, dg.RunRequest) and req.run_key == f"resume-{run.run_id}"
    tags = tags_of(instance, run)
    assert tags[TAG_DECISION] == "resume" and tags[TAG_FAILURE_KIND] == "preempted"


def test_a_run_stopped_with_ckpt_assets_stop_is_not_resumed(instance, store):
    run = canceled_run(instance, tags={TAG_NO_RESUME: "true"})
    assert isinstance(on_cancel(instance, run, store), dg.SkipReason)
    tags = tags_of(instance, run)
    assert tags[TAG_DECISION] == "stop" and tags[TAG_FAILURE_KIND] == "stopped_by_user"


def test_a_decision_is_taken_once_and_its_resume_is_never_launched_twice(instance, store):
    run = failed_run(instance, exit_code=-9, failure_class="killed_by_signal")
    first = on_failure(instance, run, store)
    decided = tags_of(instance, run)
    # Evaluated again before the launch: the same run_key (the daemon launches a run_key
    # once per sensor), and the decision is neither retaken nor its budget spent twice.
    again = on_failure(instance, run, store)
    assert again.run_key == first.run_key and again.tags == first.tags
    assert tags_of(instance, run) == decided
    assert len(decisions(instance)) == 1
    # Once launched, the resume is the partition's newest run: nothing acts on the failed
    # one again, neither sensor nor the reconciler long after the grace period.
    launched(instance, first)
    assert isinstance(on_failure(instance, run, store), dg.SkipReason)
    backdate_decision(instance, run, 3600, store)
    assert sweep(instance, store) == []
    assert len(decisions(instance)) == 1


# -- the reconciler ---------------------------------------------------------------------------

def test_a_failure_decided_by_a_failure_sensor_and_seen_by_the_sweep_is_launched_once(
        instance, store):
    # Both sensors see the failure; the decision is created once, only the reconciler
    # returns the resume, and asked again it returns the same run_key, which Dagster
    # launches once per sensor. No time window decides who goes first.
    run = failed_run(instance, exit_code=-9, failure_class="killed_by_signal")
    decided = _evaluate(resume_failed_training, instance, run, store)
    assert isinstance(decided, dg.SkipReason) and "reconcile_training_runs" in decided.skip_message
    (req,) = sweep(instance, store)
    (again,) = tick(instance, store)
    assert req.run_key == again.run_key == f"resume-{run.run_id}" and req.tags == again.tags
    assert len(decisions(instance)) == 1
    launched(instance, req)
    assert sweep(instance, store) == [] and tick(instance, store) == []


def test_a_failure_no_sensor_saw_is_decided_and_resumed_by_the_reconciler_at_once(
        instance, store):
    run = failed_run(instance, exit_code=143, failure_class="preempted")
    # One sweep decides and launches, however recent the end: nothing else launches resumes.
    (req,) = sweep(instance, store)
    assert req.run_key == f"resume-{run.run_id}"
    assert tags_of(instance, run)[TAG_FAILURE_KIND] == "preempted"
    assert isinstance(_evaluate(resume_failed_training, instance, run, store), dg.SkipReason)
    assert len(decisions(instance)) == 1


def backdate_end(instance, run: dg.DagsterRun, seconds: float) -> None:
    """Move the run's end `seconds` into the past, as a daemon down that long finds it."""
    end = instance.get_run_record_by_id(run.run_id).end_time
    instance.run_storage.handle_run_event(run.run_id, DagsterEvent(
        DagsterEventType.RUN_FAILURE.value, job_name=run.job_name),
        datetime.fromtimestamp(end - seconds, UTC))
    assert instance.get_run_record_by_id(run.run_id).end_time == pytest.approx(end - seconds)


def test_a_failure_a_daemon_back_from_downtime_finds_is_decided_once_and_resumed_once(
        instance, store):
    # All three sensors are evaluated at once on the old failure: one decision, one resume.
    run = failed_run(instance, exit_code=-9, failure_class="killed_by_signal")
    backdate_end(instance, run, 3600)
    skip = _evaluate(resume_failed_training, instance, run, store)
    assert isinstance(skip, dg.SkipReason)
    (req,) = sweep(instance, store)
    assert isinstance(_evaluate(resume_failed_training, instance, run, store), dg.SkipReason)
    assert req.run_key == f"resume-{run.run_id}" and len(decisions(instance)) == 1


def test_a_backed_off_resume_is_launched_by_the_reconciler_only_once_it_is_due(
        instance, store, monkeypatch):
    monkeypatch.setenv("CKPT_BACKOFF_BASE_S", "30")
    budget = {"transient": 0, "resumed_from_step": 20, "high_step": 20, "failures": 1}
    run = failed_run(instance, exit_code=5, failure_class="storage_unavailable",
                     tags={TAG_BUDGET: json.dumps(budget)})
    skip = on_failure(instance, run, store)  # again at step 20, no progress: 30 s back-off
    assert isinstance(skip, dg.SkipReason) and "after 30s" in skip.skip_message
    assert tags_of(instance, run)[TAG_DECISION] == "resume"
    assert sweep(instance, store) == []  # not due yet
    backdate_decision(instance, run, 31, store)
    (req,) = sweep(instance, store)
    assert req.run_key == f"resume-{run.run_id}"
    assert carried_budget(req)["transient"] == 1


def test_a_started_run_whose_trainer_stopped_heartbeating_is_marked_failed(instance, store):
    run = started_run(instance, started_ago=3600)
    beat(store, age_s=3600)
    sweep(instance, store)
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
    # Then it is an ended run like any other: the policy resumes a lost trainer.
    req = on_failure(instance, run, store)
    assert isinstance(req, dg.RunRequest)
    assert tags_of(instance, run)[TAG_FAILURE_KIND] == "killed"


def test_a_started_run_with_a_fresh_heartbeat_is_left_alone(instance, store):
    run = started_run(instance, started_ago=3600)
    beat(store, age_s=0)
    assert sweep(instance, store) == []
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED


def test_a_run_whose_heartbeat_cannot_be_read_is_not_judged_dead(instance, store, monkeypatch):
    # A store that does not answer is no evidence: "no heartbeat" would kill a healthy trainer.
    def store_down(self):
        raise StorageError("s3://bucket/e/run-a/heartbeat.json: endpoint did not answer")

    run = started_run(instance, started_ago=3600)
    monkeypatch.setattr(CheckpointRepo, "read_beat", store_down)
    skipped = reconcile_training_runs(dg.build_sensor_context(
        instance=instance, resources={"checkpoint_store": store, **NO_MLFLOW}))
    assert isinstance(skipped, dg.SkipReason)
    assert f"{run.run_id[:8]}: not judged, its heartbeat could not be read from the store " \
           "(StorageError: s3://bucket/e/run-a/heartbeat.json: endpoint did not answer)" \
           in skipped.skip_message
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED
    assert TAG_HEARTBEAT_LOST not in tags_of(instance, run)


def test_a_run_that_just_started_is_given_time_before_its_first_heartbeat(instance, store):
    run = started_run(instance, started_ago=0)
    sweep(instance, store)
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED


# -- liveness: dead, stalled, and the trainer retired before the resume ------------------------

def write_beat(store: CheckpointStore, run: dg.DagsterRun | None = None, *, age_s: float = 0.0,
               step_age_s: float = 0.0, proc: ProcessId | None = None,
               ended: bool = False) -> None:
    """A heartbeat of `run`'s trainer, written `age_s` ago, its step reached `step_age_s` ago,
    by process `proc` (None: a process nobody can signal from here); `ended`: its session's
    last beat."""
    now = time.time()
    where = {} if proc is None else {**proc.to_dict(), "host": socket.gethostname()}
    where.setdefault("pid", 1)
    body = Beat(time=now - age_s, step=20,
                step_time=now - step_age_s, attempt=1, resumed_step=0,
                dagster_run_id=run.run_id if run else None,
                ended=now - age_s if ended else None, **where)
    repo = _repo(store)
    repo.store.write_overwrite(f"{repo.prefix}/heartbeat.json", json.dumps(body.to_dict()).encode())


@pytest.fixture
def processes():
    """Real processes standing in for trainers; whatever is left is killed at the end."""
    started: list[subprocess.Popen] = []

    def start(code: str = "import time; time.sleep(600)") -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", f"print('ready', flush=True); {code}"],
                                stdout=subprocess.PIPE, text=True, start_new_session=True)
        started.append(proc)
        assert proc.stdout.readline().strip() == "ready"  # its signal handlers are set
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_step_three_times_the_heartbeat_timeout_with_a_fresh_heartbeat_is_left_alone(
        instance, store):
    timeout = ResumeSettings().heartbeat_timeout_s
    run = started_run(instance, started_ago=3600)
    write_beat(store, run, age_s=0, step_age_s=3 * timeout)
    assert sweep(instance, store) == []
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED
    assert TAG_HEARTBEAT_LOST not in tags_of(instance, run)


def test_a_trainer_heartbeating_without_a_step_past_the_stall_limit_is_stalled_and_resumed(
        instance, store, monkeypatch):
    monkeypatch.setenv("CKPT_STALL_TIMEOUT_S", "600")
    run = started_run(instance, started_ago=3600)
    write_beat(store, run, age_s=0, step_age_s=599)
    sweep(instance, store)
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED
    write_beat(store, run, age_s=0, step_age_s=601)
    sweep(instance, store)
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
    assert "no step completed for 601s since step 20" in tags_of(instance, run)[TAG_STALLED]
    req = on_failure(instance, run, store)
    assert isinstance(req, dg.RunRequest)
    tags = tags_of(instance, run)
    assert tags[TAG_FAILURE_KIND] == Kind.STALLED == Outcome.STALLED.kind
    # A hang may pass (this one after progress, so at once); the budgets bound it.
    assert carried_budget(req)["failures"] == 1


def test_a_trainer_relaunched_in_its_run_is_judged_from_its_own_start_not_the_old_beat(
        instance, store, monkeypatch):
    # Attempt 1 beat last an hour ago and died; the run relaunched attempt 2 in itself 14 s
    # ago, whose start-up (slow on a loaded machine) has not beaten yet.
    monkeypatch.setenv("CKPT_HEARTBEAT_TIMEOUT_S", "20")
    run = started_run(instance, started_ago=3600, tags={
        TAG_ATTEMPT: "2", TAG_ATTEMPT_STARTED_AT: iso(time.time() - 14)})
    write_beat(store, run, age_s=3600)  # attempt 1's last beat
    sweep(instance, store)
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED
    assert TAG_HEARTBEAT_LOST not in tags_of(instance, run)


def test_a_fresh_heartbeat_of_another_runs_trainer_does_not_keep_this_run_alive(instance, store):
    older = started_run(instance, started_ago=3600)
    instance.report_run_failed(older, "an earlier attempt")
    run = started_run(instance, started_ago=3600)
    write_beat(store, older, age_s=0)  # its trainer lives on, heartbeating: not this run's
    sweep(instance, store)
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
    assert tags_of(instance, run)[TAG_HEARTBEAT_LOST].startswith("trainer heartbeat lost (none")


def test_a_run_without_a_live_trainer_is_given_the_worker_grace_not_the_timeout(
        instance, store):
    # Before its trainer: the run worker, the dataset's manifest and the trainer's imports.
    settings = ResumeSettings()
    run = started_run(instance, started_ago=settings.heartbeat_timeout_s + 30)
    assert sweep(instance, store) == []
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED
    # After it: the final model's evaluation and export, however long they take.
    write_beat(store, run, age_s=settings.heartbeat_timeout_s + 30, ended=True)
    assert sweep(instance, store) == []
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED
    write_beat(store, run, age_s=settings.worker_grace_s + 1, ended=True)
    sweep(instance, store)
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
    assert "run worker lost: its trainer ended" in tags_of(instance, run)[TAG_HEARTBEAT_LOST]
    late = started_run(instance, started_ago=settings.worker_grace_s + 1)
    sweep(instance, store)
    assert instance.get_run_by_id(late.run_id).status == dg.DagsterRunStatus.FAILURE


def test_a_trainer_declared_dead_is_fenced_so_it_never_commits_or_claims_again(instance, store):
    zombie = _repo(store)
    assert zombie.claim("step-000000020-a1", at_least=2, launched=True) == 2
    run = started_run(instance, started_ago=3600, tags={TAG_ATTEMPT: "2"})
    write_beat(store, run, age_s=3600)
    sweep(instance, store)
    assert "fenced: attempts up to 2" in retired(instance, run)
    pending = zombie.begin(25, 2)
    with zombie.write_file(pending, "state.pt") as w:
        w.write(b"state at step 25")
    with pytest.raises(PointerConflictError):
        zombie.commit(pending, {})
    with pytest.raises(PointerConflictError, match="declared failed"):
        _repo(store).claim("step-000000020-a1", at_least=2, launched=True)
    ptr = _repo(store).read_pointer()
    assert (ptr.checkpoint, ptr.step, ptr.fenced_through) == ("step-000000020-a1", 20, 2)
    # The resume is the next attempt: its claim is not refused.
    req = on_failure(instance, run, store)
    assert req.tags[TAG_ATTEMPT] == "3"
    assert _repo(store).claim("step-000000020-a1", at_least=3, launched=True) == 3


@pytest.mark.slow
def test_a_frozen_trainer_on_this_machine_is_stopped_with_its_group_before_the_run_fails(
        instance, store, processes):
    trainer = processes()
    os.kill(trainer.pid, signal.SIGSTOP)  # alive but silent
    run = started_run(instance, started_ago=3600)
    write_beat(store, run, age_s=3600, proc=ProcessId.of(trainer.pid))
    requests = sweep(instance, store)
    # Gone by the time the run is failed (the sweep waited for it): no wait needed here.
    assert trainer.poll() == -signal.SIGTERM
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE
    assert f"trainer pid {trainer.pid} on {socket.gethostname()} stopped by SIGTERM" in \
        retired(instance, run)
    # The sweep that failed the run decides it and launches its resume at once: no grace
    # leaves it to another sensor, and the failure sensor's look after it decides nothing.
    assert [r.run_key for r in requests] == [f"resume-{run.run_id}"]
    assert tags_of(instance, run)[TAG_FAILURE_KIND] == "killed"
    on_failure(instance, run, store)
    assert len(decisions(instance)) == 1


@pytest.mark.slow
def test_a_frozen_trainer_holding_the_pointer_lock_is_killed_at_once_then_fenced(
        instance, store, processes):
    # Frozen inside a commit: the fence cannot take the pointer's lock until the trainer is
    # gone, and a trainer not fenced gets no SIGTERM grace (it could commit in it).
    repo = _repo(store)
    lock = repo.store.root / Path(repo.pointer_key).parent / f".{Path(repo.pointer_key).name}.lock"
    trainer = processes(f"import fcntl, os, time; fd = os.open({str(lock)!r}, os.O_RDWR); "
                        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); "
                        "time.sleep(600)")
    assert trainer.stdout.readline().strip() == "locked"
    os.kill(trainer.pid, signal.SIGSTOP)
    run = started_run(instance, started_ago=3600)
    write_beat(store, run, age_s=3600, proc=ProcessId.of(trainer.pid))
    generation = repo.read_pointer().generation
    sweep(instance, store)
    assert trainer.poll() == -signal.SIGKILL
    said = retired(instance, run)
    assert f"NOT fenced (LockHeldError: {repo.store.uri_for(repo.pointer_key)}" in said, said
    assert f"locked by process {trainer.pid}, which is stopped" in said, said
    assert f"trainer pid {trainer.pid} on {socket.gethostname()} killed (SIGKILL at once)" in said
    assert "then: fenced: attempts up to 1" in said, said
    assert repo.read_pointer().generation == generation + 1
    with pytest.raises(PointerConflictError):
        repo.claim("step-000000020-a1", at_least=1, launched=True)
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE


@pytest.mark.slow
def test_a_trainer_that_ignores_sigterm_is_killed_after_the_grace(
        instance, store, processes, monkeypatch):
    monkeypatch.setenv("CKPT_STOP_GRACE_S", "0.5")
    monkeypatch.setenv("CKPT_STALL_TIMEOUT_S", "600")
    trainer = processes("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                        "time.sleep(600)")
    run = started_run(instance, started_ago=3600)
    write_beat(store, run, age_s=0, step_age_s=700, proc=ProcessId.of(trainer.pid))
    sweep(instance, store)
    assert trainer.poll() == -signal.SIGKILL
    assert "killed (SIGKILL 0s after SIGTERM)" in retired(instance, run)


@pytest.mark.slow
@pytest.mark.parametrize("elsewhere,said", [
    pytest.param(lambda p: dataclasses.replace(p, machine="another-boot/pid:[4026531836]"),
                 "its launcher could not", id="a trainer on another machine"),
    pytest.param(lambda p: dataclasses.replace(p, start_ticks=p.start_ticks - 1),
                 "already gone", id="a trainer whose pid another process reuses"),
])
def test_a_process_that_is_not_the_trainer_is_never_signalled(
        instance, store, processes, elsewhere, said):
    bystander = processes()
    run = started_run(instance, started_ago=3600)
    write_beat(store, run, age_s=3600, proc=elsewhere(ProcessId.of(bystander.pid)))
    sweep(instance, store)
    assert bystander.poll() is None
    done = retired(instance, run)
    assert said in done and "fenced: attempts up to 1" in done
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.FAILURE


def test_the_trainers_exit_caused_by_the_reconciler_does_not_decide_how_the_attempt_ended(
        instance, store):
    # Fenced and stopped, the trainer exits 6 (superseded, never resumed by itself); the
    # reconciler's verdict on the run is what the policy decides on.
    run = failed_run(instance, exit_code=6, failure_class="superseded",
                     tags={TAG_HEARTBEAT_LOST: "trainer heartbeat lost (130s old, timeout 120s)"})
    req = on_failure(instance, run, store)
    assert isinstance(req, dg.RunRequest)
    assert tags_of(instance, run)[TAG_FAILURE_KIND] == "killed"
    (decision,) = decisions(instance)
    assert decision["failure_class"] == Outcome.HEARTBEAT_LOST.value
