"""One MLflow run per training run across attempts, with a continuous step axis; lineage
of attempts and checkpoints after a run that was killed once and resumed."""

from __future__ import annotations

import json
import shutil
import signal

import dagster as dg
import pytest
from mlflow.tracking import MlflowClient

from ckpt_assets.base.events import CHECKPOINT, partition_events
from ckpt_assets.cli.main import main as cli_main
from ckpt_assets.definitions import make_resources
from ckpt_assets.lifecycle.settings import Setting
from ckpt_assets.mlflow.tracking import TRAINING_RUN_TAG
from ckpt_assets.records.history import RESUME_MARK
from tests.dagster_fixtures import (
    ROOT,
    TrainerKiller,
    checkpoints,
    made_mlflow_db,
    materializations,
    materialize_run,
    step_failure_metadata,
    training_config,
)

pytestmark = pytest.mark.slow

KEY = "resumed"


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """Attempt 1 is SIGKILLed (the trainer process, from outside) after step 20 is
    committed; attempt 2 is a new materialization of the same partition that resumes."""
    base = tmp_path_factory.mktemp("resumed")
    home = base / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    store = base / "store"
    tracking = made_mlflow_db(base / "mlflow.db")
    cfg = training_config(max_steps=60, task_args={"step_delay": 0.03},
                          checkpoint={"keep_last": 20})  # keep every link of the chain
    resources = make_resources(str(store), tracking_uri=tracking)
    with dg.DagsterInstance.from_config(str(home)) as instance, \
            pytest.MonkeyPatch.context() as mp:
        # Two Dagster runs are the point (lineage and one MLflow run across them): the
        # killed trainer's step must fail rather than relaunch it in its own run.
        mp.setenv(Setting.IN_RUN_RELAUNCH, "0")
        killer = TrainerKiller(store, "default", KEY, at_step=20, sig=signal.SIGKILL)
        killer.start()
        first = materialize_run(instance, KEY, resources, training=cfg)
        killer.join(5)
        assert killer.killed_pid, "the trainer was not killed"
        second = materialize_run(instance, KEY, resources)
        yield {"first": first, "second": second, "tracking": tracking, "home": home,
               "instance": instance,
               "store": store, "killed_at": killer.step_seen, "config": cfg}


def _stored_steps(instance: dg.DagsterInstance, run_id: str) -> list[int]:
    return sorted(int(md["step"]) for md, rec in partition_events(instance, KEY, CHECKPOINT)
                  if rec.run_id == run_id)


def _reported(result) -> list[dict]:
    """Checkpoints the run's own trainer reported. A checkpoint attempt 1 committed in the
    instant between its commit and its report (the killer acts on the pointer) is recorded
    late by attempt 2 instead, flagged `recorded_late`."""
    return [m for m in checkpoints(result) if not m.get("recorded_late")]


def _mlflow_runs(tracking: str):
    client = MlflowClient(tracking_uri=tracking)
    exp = client.get_experiment_by_name("default")
    runs = client.search_runs([exp.experiment_id],
                              filter_string=f"tags.{TRAINING_RUN_TAG} = '{KEY}'")
    return client, runs


def test_the_first_attempt_failed_as_killed_and_the_second_resumed_and_finished(resumed_run):
    first, second = resumed_run["first"], resumed_run["second"]
    assert not first.success and second.success
    _, md = step_failure_metadata(first)
    assert md["exit_code"] == -signal.SIGKILL and md["failure_class"] == "killed_by_signal"
    assert md["last_committed_step"] >= 20 and md["attempt"] == 1
    ckpts = _reported(second)
    assert all(m["attempt"] == 2 for m in ckpts)
    resumed_from = ckpts[0]["resumed_from_step"]
    assert resumed_from == md["last_committed_step"]
    assert ckpts[0]["root_run_id"] == second.run_id  # no sensor tags: each run is its own root
    assert ckpts[-1]["step"] == 60


def test_every_checkpoint_attempt_1_committed_is_recorded_exactly_once(resumed_run):
    from trainer.checkpoints.repo import CheckpointRepo
    from trainer.storage import open_store

    repo = CheckpointRepo(open_store(str(resumed_run["store"])), "default", KEY)
    committed = {n for n in repo.committed() if n.endswith("-a1")}
    # From the instance: a failed step's logged events are stored, not all in its result.
    with dg.DagsterInstance.from_config(str(resumed_run["home"])) as instance:
        mds = [(rec.run_id, md) for md, rec in partition_events(instance, KEY, CHECKPOINT)]
    # Reported by attempt 1's trainer, or (committed in the instant before it was killed)
    # recorded late by attempt 1's own step or by attempt 2: once either way.
    names = [md["name"] for _, md in mds if md["name"].endswith("-a1")]
    assert sorted(names) == sorted(committed)
    assert all(md["attempt"] == 1 for _, md in mds if md.get("recorded_late"))


def test_exactly_one_mlflow_run_exists_for_the_training_run_across_attempts(resumed_run):
    _, runs = _mlflow_runs(resumed_run["tracking"])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["attempt"] == "2"
    assert run.data.tags["dagster_run_id"] == resumed_run["second"].run_id
    assert run.data.tags["dagster_root_run_id"] == resumed_run["second"].run_id


def test_the_mlflow_step_history_is_strictly_increasing_and_continuous_across_attempts(
        resumed_run):
    client, (run,) = _mlflow_runs(resumed_run["tracking"])
    hist = client.get_metric_history(run.info.run_id, "loss")
    steps = [m.step for m in sorted(hist, key=lambda m: (m.timestamp, m.step))]
    assert steps == sorted(set(steps)), f"steps repeat or go back: {steps}"
    # Continuous: exactly the committed checkpoints of attempt 1 up to the one attempt 2
    # resumed from, then attempt 2's; no gap at the seam, nothing logged twice.
    # A failed step's checkpoint observations are in the instance, not in the result's events.
    first = _stored_steps(resumed_run["instance"], resumed_run["first"].run_id)
    assert first, "attempt 1 committed checkpoints before it was killed"
    second = [m["step"] for m in _reported(resumed_run["second"])]
    resumed_from = _reported(resumed_run["second"])[0]["resumed_from_step"]
    assert set(first) <= set(steps[: len(steps) - len(second)])
    assert max(s for s in steps if s <= resumed_from) == resumed_from
    assert steps[-len(second):] == second and second[0] > resumed_from
    assert steps[-1] == 60
    for key in ("eval_loss", "eval_accuracy"):
        ev = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert ev == sorted(set(ev)) and ev[-1] == 60
    # The final model is logged to the same run.
    assert [a.path for a in client.list_artifacts(run.info.run_id, "model")] == ["model/model.pt"]
    assert client.get_metric_history(run.info.run_id, "final_eval_loss")[0].step == 60
    # One registered model per experiment; this training run is one version of it.
    (version,) = client.search_model_versions("name='default'")
    assert version.run_id == run.info.run_id and version.tags["training_run"] == KEY


def test_the_mlflow_run_shows_the_config_the_resume_and_the_failed_attempt(resumed_run):
    client, (run,) = _mlflow_runs(resumed_run["tracking"])
    params, tags = run.data.params, run.data.tags
    assert params["max_steps"] == "60" and params["checkpoint.keep_last"] == "20"
    assert params["task_args.step_delay"] == "0.03"
    resumed_from = _reported(resumed_run["second"])[0]["resumed_from_step"]
    marks = client.get_metric_history(run.info.run_id, "resumed_at_step")
    assert [(m.step, m.value) for m in marks] == [(resumed_from, float(resumed_from))]
    assert tags["attempt_1.start"] == "fresh" and tags["attempt_2.start"] == "resumed"
    assert tags["attempt_2.resumed_from_step"] == str(resumed_from)
    assert tags["attempt_1.failure_class"] == tags["last_failure_class"] == "killed_by_signal"
    assert "exited -9" in tags["last_failure_reason"]


def test_the_final_checkpoint_output_shows_the_runs_history_across_attempts(resumed_run):
    (final,) = materializations(resumed_run["second"], "model_checkpoint")
    rows = [r.data for r in final["metrics_history"].records]
    steps = [r["step"] for r in rows]
    assert steps == sorted(steps) and steps[-1] == 60 and {r["attempt"] for r in rows} == {1, 2}
    (resumed,) = [r for r in rows if r["resumed"]]
    assert resumed["attempt"] == 2 and resumed["resumed_from_step"] == min(
        r["resumed_from_step"] for r in rows if r["attempt"] == 2)
    assert final["loss_plot_image"].startswith("![loss versus step](data:image/png;base64,")
    assert RESUME_MARK in final["loss_plot"]
    assert final["uri_link"] == final["uri"][len("file://"):]


def test_the_lineage_command_shows_both_attempts_and_parent_links_across_them(
        resumed_run, monkeypatch, capsys):
    monkeypatch.setenv("DAGSTER_HOME", str(resumed_run["home"]))
    assert cli_main(["lineage", KEY, "--json", "--store", str(resumed_run["store"])]) == 0
    rep = json.loads(capsys.readouterr().out)
    attempts = rep["attempts"]
    assert [a["status"] for a in attempts] == ["FAILURE", "SUCCESS"]
    assert [a["dagster_run_id"] for a in attempts] == [resumed_run["first"].run_id,
                                                       resumed_run["second"].run_id]
    cks = rep["checkpoints"]
    names = {c["name"] for c in cks}
    # Every retained checkpoint's parent is the one before it in the run's history,
    # and the first checkpoint of attempt 2 points back into attempt 1.
    first_a2 = min((c for c in cks if c["attempt"] == 2), key=lambda c: c["step"])
    assert first_a2["parent"].endswith("-a1")
    assert first_a2["resumed_from_step"] == int(first_a2["parent"].split("-")[1])
    for c in cks:
        if c["parent"] in names:
            parent = next(p for p in cks if p["name"] == c["parent"])
            assert parent["step"] < c["step"]
    assert rep["latest_checkpoint"] == "step-000000060-a2"
    assert rep["final_model"]["uri"].endswith("/default/resumed/models/v-000001")
    assert cli_main(["lineage", KEY, "--store", str(resumed_run["store"])]) == 0
    text = capsys.readouterr().out
    assert "attempt 1" in text and "attempt 2" in text and "<- latest" in text


def test_the_list_command_reports_state_attempts_step_and_latest_checkpoint(
        resumed_run, monkeypatch, capsys):
    monkeypatch.setenv("DAGSTER_HOME", str(resumed_run["home"]))
    assert cli_main(["list", "--json", "--store", str(resumed_run["store"])]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["run"] == KEY and row["state"] == "finished" and row["attempts"] == 2
    assert row["latest_step"] == 60 and row["latest_checkpoint"].endswith("step-000000060-a2")
