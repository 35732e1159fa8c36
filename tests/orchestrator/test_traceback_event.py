"""A bug in the training code ends the attempt with its traceback as one event, end to end:
the real trainer under Pipes, `materialize()` on an ephemeral instance."""

from __future__ import annotations

import dagster as dg
import pytest

from ckpt_assets.definitions import make_resources
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import materialize_run, step_failure_metadata, training_config

pytestmark = pytest.mark.slow


def test_a_bug_in_training_code_is_one_error_event_with_its_traceback_not_one_per_line(
        instance, tmp_path, mlflow_uri):
    res = materialize_run(instance, "buggy", make_resources(
        str(tmp_path / "store"), tracking_uri=mlflow_uri),
        training=training_config(task_args={"fail_at_step": 15}), with_checks=False)
    assert not res.success
    messages = [(r.level, r.user_message) for r in instance.all_logs(res.run_id)
                if r.dagster_event is None]
    with_tb = [(lvl, m) for lvl, m in messages if "Traceback (most recent call last):" in m]
    errors = [m for lvl, m in with_tb if lvl >= 40]
    assert len(errors) == 1 and "user_code_error" in errors[0]
    # The process's own output of the same traceback: one entry too, never a frame per line.
    assert len(with_tb) <= 2
    assert not [m for _, m in messages if m.startswith("[trainer]   File ")]
    _, md = step_failure_metadata(res)
    assert md["failure_class"] == "user_code_error"
    assert md["traceback"].startswith("```\nTraceback (most recent call last):")
    assert dg.DagsterRunStatus.FAILURE == instance.get_run_by_id(res.run_id).status
