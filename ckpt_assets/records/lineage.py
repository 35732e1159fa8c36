"""Lineage: the run tags that chain attempts, and the lineage report of a training run
(attempts, checkpoints with their parent links, the final model), read from the Dagster
event log and the store. MLflow tracking lives in `ckpt_assets.mlflow.tracking`.
"""

from __future__ import annotations

import json
from typing import Any

import dagster as dg

from ckpt_assets.base.events import ATTEMPT_ENDED, CHECKPOINT, decisions, partition_events
from ckpt_assets.base.queries import training_runs_of
from ckpt_assets.base.registration import read_registration
from ckpt_assets.base.tags import (
    TAG_ATTEMPT,
    TAG_NO_RESUME,
    TAG_PARENT_RUN_ID,
    TAG_ROOT_RUN_ID,
    TAG_STOP_REASON,
)
from ckpt_assets.lifecycle.decision_record import read_decision
from ckpt_assets.lifecycle.ended import lost_worker, stop_reason_text
from ckpt_assets.records.asset_versions import VersionedRepo
from trainer.base.errors import CheckpointError, StorageError
from trainer.base.outcomes import Outcome
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import ObjectStore

# -- lineage report ---------------------------------------------------------------------------

def dagster_runs_of(instance: dg.DagsterInstance, run_key: str) -> list[dg.DagsterRun]:
    """The Dagster runs that trained one training run (partition), oldest first."""
    return list(reversed(training_runs_of(instance, run_key)))


def checkpoint_timeline(repo: CheckpointRepo) -> list[dict[str, Any]]:
    """Committed checkpoints of the run with their parent links, oldest first."""
    out = []
    for name in repo.committed():
        try:
            m = repo.read_manifest(name)
        except CheckpointError as e:
            out.append({"name": name, "error": str(e)})
            continue
        lin = m.meta.get("lineage") or {}
        out.append({"name": name, "uri": repo.uri(name), "step": m.step, "attempt": m.attempt,
                    "parent": m.parent, "sha256": m.sha256, "size": m.total_size,
                    "loss": m.meta.get("loss"), "dagster_run_id": lin.get("dagster_run_id"),
                    "resumed_from_step": lin.get("resumed_from_step"),
                    "code_version": lin.get("code_version"),
                    "data_version": lin.get("data_version")})
    return out


def lineage_report(instance: dg.DagsterInstance, store: ObjectStore, run_key: str) -> dict[str, Any]:
    """Attempts (Dagster runs), checkpoints with parent links, and the final model."""
    reg = read_registration(store, run_key)
    if reg is None:
        raise KeyError(run_key)
    attempts = _attempt_rows(instance, run_key)
    # What each attempt did and why it was (not) resumed: observations on the partition.
    # One Dagster run holds several attempts when its trainer was relaunched in it
    # (`ckpt_assets.attempt.in_run`): one row per attempt_ended, in order.
    ends: dict[str, list[dict[str, Any]]] = {}
    # By the Dagster run the attempt belongs to: the decider records a lost attempt's end
    # outside any run (`lifecycle.decision`).
    for md, rec in partition_events(instance, run_key, ATTEMPT_ENDED):
        ends.setdefault(md.get("dagster_run_id") or rec.run_id, []).append(md)
    reasons = {md["failed_run_id"]: md.get("reason") for md in decisions(instance, run_key)}
    decided = _decided_classes(store, run_key, attempts)
    repo = CheckpointRepo(store, reg.experiment, run_key)
    timeline = checkpoint_timeline(repo)
    stored = {c["name"] for c in timeline}
    # Every committed checkpoint was observed (those an attempt committed after its
    # orchestrator died, late, by the next attempt), so the history outlives retention.
    # A checkpoint belongs to the Dagster run that launched its trainer (its lineage), not
    # to the run that logged the event: a late record is logged by the next attempt.
    checkpoints: dict[str, dict[str, Any]] = {}
    for md, rec in partition_events(instance, run_key, CHECKPOINT):
        if not md.get("name") or md["name"] in checkpoints:
            continue
        checkpoints[md["name"]] = {
            "name": md.get("name"), "uri": md.get("uri"), "step": md.get("step"),
            "attempt": md.get("attempt"), "parent": md.get("parent"),
            "sha256": md.get("sha256"), "size": md.get("size"), "loss": md.get("loss"),
            "dagster_run_id": md.get("dagster_run_id") or rec.run_id,
            "stored": md.get("name") in stored, "recorded_late": bool(md.get("recorded_late")),
            **{k: md.get(k) for k in ("resumed_from_step", "code_version", "data_version")}}
    checkpoints = list(checkpoints.values()) + [
        dict(c, stored=True, recorded_late=False, unrecorded=True)
        for c in timeline if c["name"] not in checkpoints]
    checkpoints.sort(key=lambda c: (c.get("step") or 0, c.get("attempt") or 0))
    by_run: dict[str, list[dict[str, Any]]] = {}
    for c in checkpoints:
        if c.get("dagster_run_id"):
            by_run.setdefault(c["dagster_run_id"], []).append(c)
    attempts = _attempts_ended(attempts, ends, by_run, reasons, decided)
    try:
        ptr = repo.read_pointer()
    except CheckpointError:
        ptr = None
    return {"run": run_key, "experiment": reg.experiment, "config_uri": reg.config_uri,
            "attempts": attempts, "checkpoints": checkpoints,
            "latest_checkpoint": ptr.checkpoint if ptr else None,
            "final_model": _final_model(store, reg.experiment, run_key)}


def _decided_classes(store: ObjectStore, run_key: str,
                     attempts: list[dict[str, Any]]) -> dict[str, str]:
    """How each ended Dagster run's last attempt ended, as its decision recorded it: the
    name the decision, list, the state check and the run's tags use, whatever the run's
    worker managed to record before it went (or did not)."""
    out = {}
    for a in attempts:
        if a["status"] in ("FAILURE", "CANCELED"):
            try:
                rec = read_decision(store, run_key, a["dagster_run_id"])
            except StorageError:  # lineage still reads; the event's name stands
                rec = None
            if rec is not None and rec.failure_class:
                out[a["dagster_run_id"]] = rec.failure_class
    return out


def _attempts_ended(attempts: list[dict[str, Any]], ends: dict[str, list[dict[str, Any]]],
                    by_run: dict[str, list[dict[str, Any]]], reasons: dict[str, Any],
                    decided: dict[str, str]) -> list[dict[str, Any]]:
    """One row per attempt: a Dagster run's row, once per attempt it held (a trainer
    relaunched in the run is an attempt of its own, whether or not it lived to record its
    end), with how each ended: a run's last attempt by its decision's name where one was
    decided."""
    held = {a["dagster_run_id"]: _held(a, ends.get(a["dagster_run_id"], [])) for a in attempts}
    rows = [(dict(a), e, i < len(es) - 1) for a in attempts
            for es in [held[a["dagster_run_id"]]] for i, e in enumerate(es)]
    attempts = [a for a, _, _ in rows]
    for position, (a, e, relaunched) in enumerate(rows, start=1):
        stopped = a.pop("stopped", None)
        own = [c for c in by_run.get(a["dagster_run_id"], [])
               if len(held[a["dagster_run_id"]]) < 2 or c.get("attempt") == e.get("attempt")]
        a.update(exit_code=e.get("exit_code"), failure_class=e.get("failure_class"),
                 last_committed_step=e.get("last_committed_step"),
                 resumed_from_step=e.get("resumed_from_step"), relaunched_in_run=relaunched,
                 decision=("relaunched in the same Dagster run" if relaunched
                           else stopped or reasons.get(a["dagster_run_id"])))
        # The attempt number the trainer claimed (on its checkpoints) is the truth; the tag
        # is what the orchestrator asked for; a run launched by hand and lost before it
        # reported anything is numbered by its place among the partition's runs.
        tag = str(a["attempt"] or "")
        a["attempt"] = (e.get("attempt") or next((c["attempt"] for c in own if c.get("attempt")),
                                                 None) or (int(tag) if tag.isdigit() else position))
        a["end"] = _attempt_end(a, e)
        if not relaunched and a["dagster_run_id"] in decided:
            a["end"] = decided[a["dagster_run_id"]]
            if a["exit_code"] is not None:
                a["failure_class"] = a["end"]
        if a["last_committed_step"] is None and own:
            a["last_committed_step"] = max(c.get("step") or 0 for c in own)
    return attempts


def _held(run: dict[str, Any], ends: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The attempts one Dagster run held, by their ends: each recorded end, and the attempt
    its tag names when that one recorded none (relaunched in the run, then lost with its run
    worker, or still training): a row without an end, numbered by the tag."""
    tag = str(run["attempt"] or "")
    recorded = [e["attempt"] for e in ends if isinstance(e.get("attempt"), int)]
    if ends and tag.isdigit() and recorded and int(tag) > max(recorded):
        return [*ends, {"attempt": int(tag)}]
    return ends or [{}]


def standalone_report(store: ObjectStore, experiment: str, run_key: str) -> dict[str, Any]:
    """The lineage of a run never launched through Dagster (a script's CheckpointSession,
    `python -m trainer`): its checkpoints with their parent links, and the attempts they
    name, all from the store. KeyError if the store has no such run."""
    repo = CheckpointRepo(store, experiment, run_key)
    try:
        ptr = repo.read_pointer()
    except CheckpointError:
        ptr = None
    timeline = checkpoint_timeline(repo)
    if ptr is None and not timeline:
        raise KeyError(run_key)
    checkpoints = [dict(c, stored=True) for c in timeline]
    checkpoints.sort(key=lambda c: (c.get("step") or 0, c.get("attempt") or 0))
    attempts = []
    for n in sorted({c["attempt"] for c in checkpoints if c.get("attempt")}):
        steps = [c["step"] for c in checkpoints if c.get("attempt") == n]
        attempts.append({"attempt": n, "dagster_run_id": None, "status": "STANDALONE",
                         "root_run_id": None, "parent_run_id": None,
                         "checkpoints": len(steps), "last_committed_step": max(steps)})
    return {"run": run_key, "experiment": experiment, "config_uri": None, "standalone": True,
            "attempts": attempts, "checkpoints": checkpoints,
            "latest_checkpoint": ptr.checkpoint if ptr else None,
            "final_model": _final_model(store, experiment, run_key)}


def _attempt_rows(instance: dg.DagsterInstance, run_key: str) -> list[dict[str, Any]]:
    """One row per Dagster run of the training run, from its tags and run record."""
    attempts = []
    for r in dagster_runs_of(instance, run_key):
        record = instance.get_run_record_by_id(r.run_id)
        attempts.append({"dagster_run_id": r.run_id, "status": r.status.value,
                         # Still STARTED, but its worker died: ended (the reconciler fails it).
                         "worker_lost": lost_worker(r) is not None,
                         "started": bool(record and record.start_time),
                         "attempt": r.tags.get(TAG_ATTEMPT),
                         "root_run_id": r.tags.get(TAG_ROOT_RUN_ID, r.run_id),
                         "parent_run_id": r.tags.get(TAG_PARENT_RUN_ID),
                         "job": r.job_name,
                         # A stop for good overrides whatever was decided before it.
                         "stopped": stop_reason_text(r.tags.get(TAG_STOP_REASON))
                         if r.tags.get(TAG_NO_RESUME) == "true" else None})
    return attempts


def _final_model(store: ObjectStore, experiment: str, run_key: str) -> dict[str, Any] | None:
    """The final model's current version (None before there is one; its error if unreadable)."""
    models = VersionedRepo(store, experiment, run_key, "models")
    try:
        name = models.current()
        if not name:
            return None
        m = models.read_manifest(name)
        return {"uri": models.uri(name), "version": m.step,
                "sha256": m.files[m.meta["filename"]]["sha256"],
                "dagster_run_id": m.meta.get("dagster_run_id")}
    except CheckpointError as e:
        return {"error": str(e)}


WORKER_LOST = Outcome.WORKER_LOST.value  # the run ended without recording the trainer's exit


def _attempt_end(a: dict[str, Any], ended: dict[str, Any]) -> str | None:
    """How an attempt ended: its trainer's failure class when the step recorded the exit;
    `worker_lost` when a run that started ended without that record (its run worker died:
    the trainer's exit is unknown); `not_started` for one canceled or failed before it
    started; None while the run is still going."""
    if ended.get("exit_code") is not None:
        return ended.get("failure_class") or "exited"
    if a["status"] in ("FAILURE", "CANCELED") or a.get("worker_lost"):
        return WORKER_LOST if a["started"] else "not_started"
    if a["status"] == "SUCCESS":
        return Outcome.SUCCESS.value
    return None


def format_lineage(rep: dict[str, Any]) -> str:
    lines = [f"training run {rep['run']} (experiment {rep['experiment']})",
             f"  config: {rep['config_uri']}" if not rep.get("standalone") else
             "  standalone: never launched through Dagster (no registered config)",
             "  attempts:"]
    for a in rep["attempts"]:
        if a["dagster_run_id"] is None:
            lines.append(f"    attempt {a['attempt']}: standalone, {a['checkpoints']} "
                         f"checkpoint(s), last committed step {a['last_committed_step']}")
            continue
        lines.append(f"    attempt {a['attempt']}: dagster run {a['dagster_run_id']} "
                     f"{a['status']} (root {a['root_run_id'][:8]}, parent "
                     f"{(a['parent_run_id'] or '-')[:8]})")
        if a.get("exit_code") is not None:
            resumed = (f"resumed from step {a['resumed_from_step']}, "
                       if a.get("resumed_from_step") is not None else "")
            lines.append(f"      {resumed}trainer exit {a['exit_code']} ({a['end']}), "
                         f"last committed step {a['last_committed_step']}")
        elif a.get("end") == "not_started":
            lines.append(f"      ended {a['status']} before it started")
        elif a.get("end") and a["status"] in ("FAILURE", "CANCELED", "STARTED"):
            what = "worker lost" if a["end"] == WORKER_LOST else a["end"]
            lines.append(f"      {what}: the run ended {a['status']} without recording the "
                         f"trainer's exit (exit unknown), last committed step "
                         f"{a['last_committed_step']}")
        if a.get("decision"):
            lines.append(f"      {a['decision']}")
    lines.append("  checkpoints (oldest first):")
    for c in rep["checkpoints"]:
        if "error" in c:
            lines.append(f"    {c['name']}: UNREADABLE: {c['error']}")
            continue
        mark = " <- latest" if c["name"] == rep["latest_checkpoint"] else (
            "" if c.get("stored", True) else " (removed by retention)")
        if c.get("recorded_late"):
            mark += " (recorded late: its report was lost)"
        elif c.get("unrecorded"):
            mark += " (not yet in Dagster)"
        loss = f"{c['loss']:.4f}" if isinstance(c.get("loss"), float) else c.get("loss")
        lines.append(f"    {c['name']} step {c['step']} attempt {c['attempt']} loss {loss} "
                     f"parent {c['parent'] or '-'}{mark}")
    fm = rep["final_model"]
    lines.append(f"  final model: {json.dumps(fm) if fm and 'error' in fm else (fm or {}).get('uri', 'none')}")
    return "\n".join(lines)
