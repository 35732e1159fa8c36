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


def test_preemption_is_resumed_at_once_many_times_within_its_budget():
    cfg = PolicyConfig(max_preemptions=3)
    used = Budget()
    for step in (10, 20, 30):
        d = decide(f(exit_code=143, last_committed_step=step), used, cfg)
        assert d.resume and d.delay_s == 0 and d.kind == "preempted"
        used = d.budget
    assert not decide(f(exit_code=143, last_committed_step=40), used, cfg).resume


def test_transient_failures_after_progress_resume_at_once_and_stop_at_their_budget():
    cfg = PolicyConfig(max_transient=3, backoff_base_s=10)
    delays, used = [], Budget()
    for step in (10, 20, 30):
        d = decide(f(exit_code=-9, last_committed_step=step), used, cfg)
        assert d.resume
        delays.append(d.delay_s)
        used = d.budget
    assert delays == [0, 0, 0]
    assert not decide(f(exit_code=5, reported="storage_unavailable",
                        last_committed_step=40), used, cfg).resume


def test_transient_failures_in_a_row_at_one_step_back_off_doubling_up_to_the_maximum():
    cfg = PolicyConfig(max_transient=10, crash_loop_budget=10, backoff_base_s=10,
                       backoff_max_s=30)
    used, delays, reasons = Budget(), [], []
    for _ in range(4):
        d = decide(f(exit_code=5, reported="storage_unavailable", last_committed_step=40),
                   used, cfg)
        delays.append(d.delay_s)
        reasons.append(d.reason)
        used = d.budget
    assert delays == [0, 10, 20, 30]
    assert reasons[0].startswith("resumed at once")
    assert reasons[2].startswith("resumed after 20s (2 failure(s) in a row without the "
                                 "checkpoint advancing past step 40)")
    # Progress ends the back-off: the next failure, at a new step, resumes at once.
    assert decide(f(exit_code=-9, last_committed_step=50), used, cfg).delay_s == 0


def test_a_run_failing_again_without_advancing_its_step_stops_as_a_crash_loop():
    cfg = PolicyConfig(crash_loop_budget=2, max_transient=10)
    d1 = decide(f(exit_code=-9, last_committed_step=40), Budget(), cfg)  # got to 40: progress
    d2 = decide(f(exit_code=-9, last_committed_step=40), d1.budget, cfg)  # stuck once
    d3 = decide(f(exit_code=-9, last_committed_step=40), d2.budget, cfg)  # stuck twice
    assert d1.resume and d2.resume
    assert not d3.resume and d3.kind == "crash_loop" and "step 40" in d3.reason


def test_progress_between_failures_resets_the_crash_loop_count():
    cfg = PolicyConfig(crash_loop_budget=2, max_transient=10)
    d = decide(f(exit_code=-9, last_committed_step=40), Budget(stuck=1, resumed_from_step=40), cfg)
    assert not d.resume
    d = decide(f(exit_code=-9, last_committed_step=50), Budget(stuck=1, resumed_from_step=40), cfg)
    assert d.resume and d.budget.stuck == 0


def test_preemptions_neither_count_as_nor_reset_a_crash_loop():
    d = decide(f(exit_code=143, last_committed_step=40), Budget(stuck=1, resumed_from_step=40))
    assert d.resume and d.budget.stuck == 1


def test_a_step_that_went_down_after_a_walk_back_does_not_count_as_advancing():
    cfg = PolicyConfig(crash_loop_budget=2, max_transient=10)
    d1 = decide(f(exit_code=-9, last_committed_step=40), Budget(), cfg)
    # The next attempt walked back past a corrupt step 40 and died at 30: no progress.
    d2 = decide(f(exit_code=-9, last_committed_step=30), d1.budget, cfg)
    assert d2.resume and d2.budget.stuck == 1 and d2.budget.high_step == 40
    # Re-committing 40 again is not progress either: 40 was reached before.
    d3 = decide(f(exit_code=-9, last_committed_step=40), d2.budget, cfg)
    assert not d3.resume and d3.kind == "crash_loop"


def test_a_chain_oscillating_between_two_steps_stops_as_a_crash_loop():
    cfg = PolicyConfig(crash_loop_budget=3, max_transient=100)
    used, decisions = Budget(), []
    for step in (40, 30, 40, 30):
        d = decide(f(exit_code=-9, last_committed_step=step), used, cfg)
        decisions.append(d.resume)
        used = d.budget
    assert decisions == [True, True, True, False]


def test_a_failure_whose_step_cannot_be_read_after_a_known_step_is_not_progress():
    d = decide(f(exit_code=-9, last_committed_step=None),
               Budget(transient=1, resumed_from_step=40, high_step=40))
    assert d.resume and d.budget.stuck == 1 and d.budget.high_step == 40


def test_only_a_new_highest_step_resets_the_crash_loop_count():
    used = Budget(transient=2, stuck=1, resumed_from_step=30, high_step=40)
    assert decide(f(exit_code=-9, last_committed_step=35), used,
                  PolicyConfig(crash_loop_budget=3)).budget.stuck == 2
    assert decide(f(exit_code=-9, last_committed_step=41), used).budget.stuck == 0


def test_a_budget_carried_from_before_high_step_existed_falls_back_to_its_resumed_step():
    # Tags written by an earlier version of the sensor carry no high_step.
    d = decide(f(exit_code=-9, last_committed_step=40), Budget(transient=1, resumed_from_step=40))
    assert d.budget.stuck == 1 and d.budget.high_step == 40
