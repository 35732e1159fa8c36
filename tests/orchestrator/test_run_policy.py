"""A training run's own resume policy (`resume:` in its registered config) is what the
sensors, the reconciler and the step apply to it; the deployment's variables are the
defaults of every key it leaves out."""

from __future__ import annotations

import dagster as dg
import pytest

from ckpt_assets.base.tags import TAG_BUDGET, TAG_DECISION, TAG_DECISION_REASON
from ckpt_assets.lifecycle.settings import ResumeSettings
from tests import dagster_runs
from tests.orchestrator import test_sensors
from tests.orchestrator.test_sensors import (
    KEY,
    beat,
    failed_run,
    on_failure,
    started_run,
    sweep,
    tags_of,
)
from trainer.base.errors import ConfigError
from trainer.config import ResumeConfig, config_from_dict

# The sensors' tests' fixtures: a fresh instance, the shipped settings.
instance, timeouts = test_sensors.instance, test_sensors.timeouts

NO_PROGRESS = "transient=0 resumed_from_step=20 high_step=20 failures=1"


def store_for(tmp_path, **resume):
    return dagster_runs.store_with_a_checkpoint(tmp_path, KEY, 100,
                                                config={"resume": resume} if resume else None)


def test_a_run_registered_with_its_own_budget_is_stopped_by_it_not_the_deployments(
        instance, tmp_path):
    store = store_for(tmp_path, max_transient_failures=0)
    run = failed_run(instance, exit_code=-9, failure_class="killed_by_signal",
                     tags={TAG_BUDGET: NO_PROGRESS})
    assert isinstance(on_failure(instance, run, store), dg.SkipReason)
    tags = tags_of(instance, run)
    assert tags[TAG_DECISION] == "stop"
    assert "over the budget of 0" in tags[TAG_DECISION_REASON]


def test_a_run_that_sets_no_budget_of_its_own_gets_the_deployments(instance, tmp_path):
    store = store_for(tmp_path)
    run = failed_run(instance, exit_code=-9, failure_class="killed_by_signal",
                     tags={TAG_BUDGET: NO_PROGRESS})
    on_failure(instance, run, store)
    tags = tags_of(instance, run)
    assert tags[TAG_DECISION] == "resume"
    assert tags[TAG_DECISION_REASON] == "resumed after 10s: killed failure 1 of 3 since step 20"


@pytest.mark.parametrize("own_timeout,dead", [(None, True), (600.0, False)])
def test_a_silent_trainer_is_declared_dead_by_its_own_runs_heartbeat_timeout(
        instance, tmp_path, own_timeout, dead):
    store = store_for(tmp_path, **({"heartbeat_timeout_seconds": own_timeout}
                                   if own_timeout else {}))
    run = started_run(instance, started_ago=3600)
    beat(store, age_s=300)  # past the deployment's 120 s, within the run's own 600 s
    sweep(instance, store)
    status = instance.get_run_by_id(run.run_id).status
    assert status == (dg.DagsterRunStatus.FAILURE if dead else dg.DagsterRunStatus.STARTED)


def test_a_runs_own_keys_lie_over_the_deployments_and_the_rest_stay_its():
    own = config_from_dict({"resume": {"heartbeat_timeout_seconds": 900, "in_run_relaunch": False,
                                       "backoff_base_seconds": 1}}).resume
    base = ResumeSettings()
    got = base.for_run(own)
    assert got.heartbeat_timeout_s == 900 and not got.in_run_relaunch
    assert got.policy.backoff_base_s == 1 and got.policy.max_transient == base.policy.max_transient
    assert got.stall_timeout_s == base.stall_timeout_s
    assert base.for_run(ResumeConfig()) == base


def test_a_retired_budget_variable_is_refused_with_the_one_that_replaced_it(monkeypatch):
    monkeypatch.setenv("CKPT_CRASH_LOOP_BUDGET", "2")
    with pytest.raises(ValueError, match="unset it and set CKPT_MAX_TRANSIENT_FAILURES"):
        ResumeSettings.from_env()


@pytest.mark.parametrize("resume,what", [
    ({"heartbeat_timeout_seconds": 0}, "heartbeat_timeout_seconds"),
    ({"max_transient_failures": -1}, "max_transient_failures"),
    ({"in_run_relaunch": "yes"}, "in_run_relaunch"),
    ({"heartbeat_timeout": 60}, "heartbeat_timeout"),
])
def test_a_bad_resume_key_is_refused_by_its_path_at_registration(resume, what):
    with pytest.raises(ConfigError) as refused:
        config_from_dict({"resume": resume})
    assert "resume" in str(refused.value) and what in str(refused.value)
