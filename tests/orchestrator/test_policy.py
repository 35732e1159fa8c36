"""The failure policy's rules, one sentence each."""

from __future__ import annotations

import pytest

from ckpt_assets.base.end import AttemptEnd
from ckpt_assets.lifecycle.policy import Budget, PolicyConfig, decide
from trainer.base.outcomes import Outcome


def f(exit_code: int | None = None, reported: str | None = None, outcome: Outcome | None = None,
      **kw) -> AttemptEnd:
    """An attempt that ended with `exit_code` (and the trainer's own `reported` class)."""
    outcome = outcome or Outcome.of_exit(exit_code, reported)
    return AttemptEnd(outcome, "p", exit_code, dagster_run_id=kw.pop("run_id", "r"), **kw)


@pytest.mark.parametrize("end,kind", [
    ({"exit_code": 143}, "preempted"),
    ({"exit_code": -15}, "preempted"),
    ({"exit_code": 130}, "preempted"),
    ({"exit_code": -9}, "killed"),
    ({"exit_code": 137}, "killed"),
    ({"outcome": Outcome.WORKER_LOST}, "killed"),
    ({"outcome": Outcome.HEARTBEAT_LOST}, "killed"),
    ({"outcome": Outcome.TERMINATED}, "preempted"),
    ({"exit_code": 5, "reported": "storage_unavailable"}, "storage"),
    ({"exit_code": 2}, "bad_input"),
    ({"exit_code": 3}, "checkpoint"),
    ({"exit_code": 4}, "diverged"),
    ({"exit_code": 1, "reported": "user_code_error"}, "bug"),
    ({"exit_code": 6}, "superseded"),
    ({"exit_code": 0, "outcome": Outcome.NO_CHECKPOINT}, "no_checkpoint"),
    ({"exit_code": 77}, "unknown"),
])
def test_each_way_a_run_dies_is_classified_as_the_policy_table_says(end, kind):
    assert f(**end).kind == kind


@pytest.mark.parametrize("code", [1, 2, 3, 4, 6])
def test_bugs_bad_input_corruption_divergence_and_superseded_runs_are_never_resumed(code):
    d = decide(f(exit_code=code))
    assert not d.resume and d.reason.startswith("not resumed")


def test_preemptions_without_progress_are_resumed_at_once_up_to_their_budget():
    cfg = PolicyConfig(max_preemptions=3)
    used = Budget()
    for _ in range(3):
        d = decide(f(exit_code=143, last_committed_step=10), used, cfg)
        assert d.resume and d.delay_s == 0 and d.kind == "preempted"
        used = d.budget
    d = decide(f(exit_code=143, last_committed_step=10), used, cfg)
    assert not d.resume and "preempted 4 times since step 10" in d.reason


def test_a_run_preempted_far_more_often_than_its_budget_is_resumed_while_it_advances():
    cfg = PolicyConfig(max_preemptions=3)
    used = Budget()
    for step in range(10, 1010, 10):  # 100 preemptions, each after a new checkpoint
        d = decide(f(exit_code=143, last_committed_step=step), used, cfg)
        assert d.resume and d.budget.preemptions == 1
        used = d.budget
    assert used.failures == 100


def test_a_run_killed_ten_times_each_after_new_progress_is_resumed_at_once_every_time():
    used = Budget()
    for step in range(50, 550, 50):
        d = decide(f(exit_code=-9, last_committed_step=step), used)
        assert d.resume and d.delay_s == 0 and d.budget.transient == 0
        assert d.reason == (f"resumed at once: killed after progress to step {step} (budget "
                            "of 3 failures without progress untouched)")
        used = d.budget


def test_failures_in_a_row_without_progress_back_off_doubling_and_stop_after_the_budget():
    cfg = PolicyConfig(max_transient=3, backoff_base_s=10, backoff_max_s=30)
    used = decide(f(exit_code=-9, last_committed_step=1200), Budget()).budget  # progress
    delays, reasons = [], []
    for _ in range(3):
        d = decide(f(exit_code=-9, last_committed_step=1200), used, cfg)
        assert d.resume
        delays.append(d.delay_s)
        reasons.append(d.reason)
        used = d.budget
    assert delays == [10, 20, 30]
    assert reasons[1] == "resumed after 20s: killed failure 2 of 3 since step 1200"
    d = decide(f(exit_code=5, reported="storage_unavailable", last_committed_step=1200),
               used, cfg)
    assert not d.resume and d.kind == "crash_loop"
    assert d.reason.startswith("not resumed: crash loop, 4 storage failures in a row since "
                               "step 1200, over the budget of 3; fix the cause")
    # Progress gives the budget back: the next failure, at a new step, resumes at once.
    d = decide(f(exit_code=-9, last_committed_step=1250), used, cfg)
    assert d.resume and d.delay_s == 0 and d.budget.transient == 0


def test_a_chain_that_never_commits_is_given_the_doubt_once_then_spends_its_budget():
    used, resumed = Budget(), []
    for _ in range(5):
        d = decide(f(exit_code=-9, last_committed_step=None), used)
        resumed.append((d.resume, d.delay_s))
        used = d.budget
    assert resumed == [(True, 0), (True, 10), (True, 20), (True, 40), (False, 0)]
    first = decide(f(exit_code=-9, last_committed_step=None), Budget())
    assert first.reason.startswith("resumed at once: killed before its first checkpoint")
    assert "without a checkpoint yet" in d.reason


def test_preemptions_neither_count_as_nor_reset_failures_without_progress():
    d = decide(f(exit_code=143, last_committed_step=40),
               Budget(transient=1, resumed_from_step=40, high_step=40, failures=2))
    assert d.resume and d.budget.transient == 1 and d.budget.preemptions == 1


def test_a_step_that_went_down_after_a_walk_back_does_not_count_as_advancing():
    cfg = PolicyConfig(max_transient=1)
    d1 = decide(f(exit_code=-9, last_committed_step=40), Budget(), cfg)
    # The next attempt walked back past a corrupt step 40 and died at 30: no progress.
    d2 = decide(f(exit_code=-9, last_committed_step=30), d1.budget, cfg)
    assert d2.resume and d2.budget.transient == 1 and d2.budget.high_step == 40
    # Re-committing 40 again is not progress either: 40 was reached before.
    d3 = decide(f(exit_code=-9, last_committed_step=40), d2.budget, cfg)
    assert not d3.resume and d3.kind == "crash_loop"


def test_a_chain_oscillating_between_two_steps_stops_as_a_crash_loop():
    used, decisions = Budget(), []
    for step in (40, 30, 40, 30, 40):
        d = decide(f(exit_code=-9, last_committed_step=step), used)
        decisions.append(d.resume)
        used = d.budget
    assert decisions == [True, True, True, True, False]


def test_a_failure_whose_step_cannot_be_read_after_a_known_step_is_not_progress():
    d = decide(f(exit_code=-9, last_committed_step=None),
               Budget(resumed_from_step=40, high_step=40, failures=1))
    assert d.resume and d.budget.transient == 1 and d.budget.high_step == 40


def test_only_a_new_highest_step_gives_the_budget_back():
    used = Budget(transient=1, resumed_from_step=30, high_step=40, failures=3)
    assert decide(f(exit_code=-9, last_committed_step=35), used).budget.transient == 2
    assert decide(f(exit_code=-9, last_committed_step=41), used).budget.transient == 0


def test_a_budget_carried_from_before_high_step_existed_falls_back_to_its_resumed_step():
    # Tags written by an earlier version of the sensor carry no high_step.
    d = decide(f(exit_code=-9, last_committed_step=40),
               Budget.from_tag("transient=1 stuck=1 resumed_from_step=40"))
    assert d.budget.transient == 2 and d.budget.high_step == 40
