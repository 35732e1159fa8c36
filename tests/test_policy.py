"""The failure policy's rules, one sentence each."""

from __future__ import annotations

import pytest

from ckpt_assets.policy import Failure, PolicyConfig, classify, decide


def f(**kw) -> Failure:
    return Failure(run_id=kw.pop("run_id", "r"), partition="p", **kw)


@pytest.mark.parametrize("kw,kind", [
    ({"exit_code": 143}, "preempted"),
    ({"exit_code": -15}, "preempted"),
    ({"exit_code": -9}, "killed"),
    ({"exit_code": 137}, "killed"),
    ({"worker_lost": True}, "killed"),
    ({"canceled": True}, "preempted"),
    ({"exit_code": 5, "failure_class": "storage_unavailable"}, "storage"),
    ({"exit_code": 2}, "bad_input"),
    ({"exit_code": 3}, "checkpoint"),
    ({"exit_code": 4}, "diverged"),
    ({"exit_code": 1, "failure_class": "user_code_error"}, "bug"),
    ({"exit_code": 6}, "superseded"),
    ({}, "unknown"),
])
def test_each_way_a_run_dies_is_classified_as_the_policy_table_says(kw, kind):
    assert classify(f(**kw)) == kind


@pytest.mark.parametrize("code", [1, 2, 3, 4, 6])
def test_bugs_bad_input_corruption_divergence_and_superseded_runs_are_never_resumed(code):
    d = decide(f(exit_code=code), [])
    assert not d.resume and d.reason.startswith("not resumed")


def test_preemption_is_resumed_at_once_many_times_within_its_budget():
    cfg = PolicyConfig(max_preemptions=5)
    earlier = [f(exit_code=143, last_committed_step=s) for s in (10, 10, 10, 10)]
    d = decide(f(exit_code=143, last_committed_step=10), earlier, cfg)
    assert d.resume and d.delay_s == 0
    assert not decide(f(exit_code=143), [*earlier, f(exit_code=143)], cfg).resume


def test_transient_failures_back_off_exponentially_and_stop_at_their_budget():
    cfg = PolicyConfig(max_transient=3, backoff_base_s=5)
    a = decide(f(exit_code=-9, last_committed_step=10), [], cfg)
    b = decide(f(exit_code=5, failure_class="storage_unavailable", last_committed_step=20),
               [f(exit_code=-9, last_committed_step=10)], cfg)
    assert a.resume and a.delay_s == 5 and b.resume and b.delay_s == 10
    chain = [f(exit_code=-9, last_committed_step=s) for s in (10, 20, 30)]
    assert not decide(f(exit_code=-9, last_committed_step=40), chain, cfg).resume


def test_a_run_failing_again_without_advancing_its_step_stops_as_a_crash_loop():
    cfg = PolicyConfig(crash_loop_budget=2, max_transient=10)
    same = [f(exit_code=-9, last_committed_step=40), f(exit_code=-9, last_committed_step=40)]
    assert decide(f(exit_code=-9, last_committed_step=40), same[:1], cfg).resume
    d = decide(f(exit_code=-9, last_committed_step=40), same, cfg)
    assert not d.resume and d.kind == "crash_loop" and "step 40" in d.reason


def test_progress_between_failures_resets_the_crash_loop_count():
    cfg = PolicyConfig(crash_loop_budget=1, max_transient=10)
    chain = [f(exit_code=-9, last_committed_step=10), f(exit_code=-9, last_committed_step=20)]
    assert decide(f(exit_code=-9, last_committed_step=30), chain, cfg).resume
