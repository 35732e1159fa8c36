"""The outcome an attempt ended with, in each of the six places a user reads it.

One outcome has one name (docs/lifecycle.md): the end-to-end tests assert that every value
`outcome_names` gathers is the same, after races and faults as after plain ends.
"""

from __future__ import annotations

from typing import Any

import dagster as dg


def outcome_names(instance: dg.DagsterInstance, store_uri: str, tracking_uri: str,
                  partition: str, run_id: str, attempt: int) -> dict[str, Any]:
    """How attempt `attempt` of Dagster run `run_id` ended: its `attempt_ended` event, its
    decision (the store's record, or the in-run relaunch's for an attempt relaunched in its
    run) and its mirror on the run's tags, lineage, `list`'s row, the state check and MLflow
    (`attempt_<n>.failure_class`; `last_failure_class` too while it is the last failed one).

    `list` and the state check show a training run's latest state: they name the attempt as
    its outcome while it is the latest, and among the chain's interrupted attempts once a
    later one is (`RunState.interrupted`). The check is read as `training_run_state`
    evaluates it now (the decider and a stop record the same when they end a run)."""
    from ckpt_assets.base.view import RunView
    from ckpt_assets.lifecycle.decision_record import read_decision
    from ckpt_assets.lifecycle.state import run_state, state_check_result
    from ckpt_assets.records.lineage import lineage_report
    from ckpt_assets.records.listing import run_summary
    from trainer.storage import open_store

    store = open_store(store_uri)
    decided = read_decision(store, partition, run_id)
    ours = decided is not None and decided.attempt == attempt
    view = RunView.of(instance.get_run_by_id(run_id))
    (row,) = [a for a in lineage_report(instance, store, partition)["attempts"]
              if a["dagster_run_id"] == run_id and a["attempt"] == attempt]
    state = run_state(instance, partition)
    latest = state.dagster_run_id == run_id and state.attempt == attempt
    listed = run_summary(instance, store, partition)
    check = {k: getattr(v, "value", v) for k, v in state_check_result(state).metadata.items()}
    return {
        "event": _event(instance, partition, run_id, attempt),
        "decision": decided.failure_class if ours else _relaunch(instance, partition, run_id,
                                                                 attempt),
        "tags": view.failure_class if ours else view.interrupted.get(attempt),
        "lineage": row["end"],
        "list": listed["outcome"] if latest else next(
            (i["outcome"] for i in listed["interrupted"] if i["attempt"] == attempt), None),
        "check": check.get("outcome") if latest else
        (check.get("interrupted") or {}).get(str(attempt)),
        **_mlflow(tracking_uri, partition, attempt)}


def _event(instance: dg.DagsterInstance, partition: str, run_id: str, attempt: int) -> str:
    from ckpt_assets.base.events import ATTEMPT_ENDED, partition_events

    names = [md["failure_class"] for md, rec in
             partition_events(instance, partition, ATTEMPT_ENDED)
             if (md.get("dagster_run_id") or rec.run_id) == run_id
             and md.get("attempt") == attempt]
    return names[0] if len(names) == 1 else f"{len(names)} attempt_ended events: {names}"


def _relaunch(instance: dg.DagsterInstance, partition: str, run_id: str,
              attempt: int) -> str | None:
    """The failure class the in-run relaunch of attempt `attempt` decided over."""
    from ckpt_assets.base.events import STATE, partition_events

    return next((md["failure_class"] for md, rec in partition_events(instance, partition, STATE)
                 if rec.run_id == run_id and md.get("ended_attempt") == attempt), None)


def _mlflow(tracking_uri: str, partition: str, attempt: int) -> dict[str, str | None]:
    from mlflow.tracking import MlflowClient

    from ckpt_assets.mlflow.tracking import TRAINING_RUN_TAG

    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                filter_string=f"tags.`{TRAINING_RUN_TAG}` = '{partition}'")
    tags = run.data.tags
    last = tags.get("last_failure_class") if tags.get("last_failed_attempt") == str(attempt) \
        else None
    return {"mlflow": tags.get(f"attempt_{attempt}.failure_class"),
            **({"mlflow_last": last} if last else {})}
