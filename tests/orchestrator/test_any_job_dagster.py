"""Any training job through the assets: a task of the user's, a command, data by reference,
and each bad input answered with one clear failure that is never resumed.

Launch errors and the no-checkpoint end are classified in process by
tests/orchestrator/test_launch_errors.py; a task's bad optimizer and its evaluation mode by
tests/standalone/test_trainer_cli_in_process.py."""

from __future__ import annotations

import pytest

from ckpt_assets.base.end import AttemptEnd
from ckpt_assets.definitions import make_resources
from ckpt_assets.lifecycle.policy import decide
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import (
    ROOT,
    checkpoints,
    materializations,
    materialize_run,
    step_failure_metadata,
    training_config,
)
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import open_store

PLAIN = str(ROOT / "examples" / "plain_script" / "train.py")


def _failure(result, step="model_checkpoint") -> AttemptEnd:
    desc, md = step_failure_metadata(result, step)
    assert md is not None, "the step failed without a structured failure"
    return AttemptEnd.from_metadata(md)


def _never_resumed(f: AttemptEnd) -> None:
    d = decide(f)
    assert not d.resume, d


@pytest.mark.slow
def test_the_readme_regression_task_trains_through_dagster(instance, tmp_path, mlflow_uri):
    cfg = training_config(task="trainer.tasks.regression:build", task_args={"n": 256})
    res = materialize_run(instance, "regression", make_resources(str(tmp_path / "s")),
                          training=cfg)
    assert res.success
    ckpts = checkpoints(res)
    assert ckpts[-1]["step"] == cfg["max_steps"]
    assert ckpts[0]["user_code_version"]  # the repository holding trainer/tasks/regression.py
    assert materializations(res, "final_model")[0]["eval_loss"] < 10


@pytest.mark.slow
def test_a_command_run_trains_through_dagster_with_its_own_loop(instance, tmp_path, mlflow_uri):
    cfg = {"command": ["python", PLAIN, "--steps", "60"], "max_steps": 60,
           "checkpoint": {"heartbeat_seconds": 0.5}}
    res = materialize_run(instance, "plain", make_resources(str(tmp_path / "s")), training=cfg)
    assert res.success, step_failure_metadata(res)
    ckpts = checkpoints(res)
    assert [c["step"] for c in ckpts] == [20, 40, 60]
    assert all(c["training_run"] == "plain" and c["attempt"] == 1 for c in ckpts)
    assert ckpts[0]["user_code_version"]
    final = materializations(res, "final_model")[0]
    assert final["step"] == 60 and final["weights_sha256"]


@pytest.mark.slow
def test_a_command_is_handed_the_newest_verified_checkpoint_and_continues_from_it(
        instance, tmp_path, mlflow_uri):
    store = str(tmp_path / "s")
    short = {"command": ["python", PLAIN, "--steps", "40"], "max_steps": 40}
    assert materialize_run(instance, "handed", make_resources(store), training=short).success
    # The config is registered: a second launch of the same run is handed step 40, the
    # run's final checkpoint, so the session says it is finished and trains nothing.
    res = materialize_run(instance, "handed", make_resources(store))
    assert res.success
    logs = "\n".join(e.user_message for e in instance.all_logs(res.run_id))
    # In $CKPT_RESUME_FROM, which the session reads: no flag the script must know.
    assert "--resume-from" not in logs
    assert "already finished at step 40 (file://" in logs and "step-000000040-a1)" in logs


def test_a_missing_dataset_fails_the_dataset_step_as_bad_input(instance, tmp_path, mlflow_uri):
    cfg = training_config(dataset=str(tmp_path / "nowhere"))
    res = materialize_run(instance, "nodata", make_resources(str(tmp_path / "s")), training=cfg)
    f = _failure(res, "training_dataset")
    assert (f.exit_code, f.failure_class) == (2, "bad_input")
    assert "does not exist" in f.message
    _never_resumed(f)


@pytest.mark.slow
def test_a_dataset_file_is_versioned_passed_by_uri_and_a_changed_byte_is_refused(
        instance, tmp_path, mlflow_uri):
    from trainer.tasks.toy import write_dataset

    data = tmp_path / "toy.pt"
    write_dataset(data, n_train=256, n_eval=128)
    store = str(tmp_path / "s")
    cfg = training_config(dataset=str(data))
    res = materialize_run(instance, "data-run", make_resources(store), training=cfg)
    assert res.success, step_failure_metadata(res)
    ds = materializations(res, "training_dataset")[0]
    assert ds["kind"] == "uri" and ds["files"] == 1 and ds["uri"] == str(data)
    ckpts = checkpoints(res) + materializations(res, "model_checkpoint")
    assert {c["data_version"] for c in ckpts} == {ds["data_version"]}
    assert {c["dataset"] for c in ckpts} == {str(data)}
    committed = CheckpointRepo(open_store(store), "default", "data-run").committed()

    raw = bytearray(data.read_bytes())
    raw[-20] ^= 0xFF
    data.write_bytes(bytes(raw))
    again = materialize_run(instance, "data-run", make_resources(store))
    f = _failure(again, "training_dataset")
    assert (f.exit_code, f.failure_class) == (2, "bad_input")
    assert "the dataset changed" in f.message and "register a new training run" in f.message
    assert CheckpointRepo(open_store(store), "default", "data-run").committed() == committed
