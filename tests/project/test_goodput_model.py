"""The model behind benchmarks/bench_goodput.py: its failure schedule is seeded, and the
formulas it prints beside the measurement are the ones it names."""

from __future__ import annotations

import importlib.util
import math
import random
import statistics
import sys

import pytest

from tests.daemon_harness import ROOT

_spec = importlib.util.spec_from_file_location("bench_goodput",
                                               ROOT / "benchmarks" / "bench_goodput.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_goodput", bench)
_spec.loader.exec_module(bench)


def test_the_same_seed_draws_the_same_failure_schedule_and_another_seed_another():
    a = bench.failure_schedule(7, 120.0, 3600.0, 0.5)
    assert a == bench.failure_schedule(7, 120.0, 3600.0, 0.5)
    assert a != bench.failure_schedule(8, 120.0, 3600.0, 0.5)
    assert all(f.at_s < 3600.0 for f in a) and [f.at_s for f in a] == sorted(f.at_s for f in a)


def test_failures_arrive_at_the_mean_interval_asked_for_in_the_share_of_kinds_asked_for():
    sched = bench.failure_schedule(1, 60.0, 60.0 * 5000, 0.25)
    gaps = [b.at_s - a.at_s for a, b in zip(sched, sched[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(60.0, rel=0.05)
    # Exponential: the standard deviation equals the mean.
    assert statistics.stdev(gaps) == pytest.approx(60.0, rel=0.08)
    workers = sum(f.strike is bench.Strike.WORKER for f in sched) / len(sched)
    assert workers == pytest.approx(0.25, abs=0.03)
    assert {f.strike for f in bench.failure_schedule(1, 60.0, 6000.0, 0.0)} == {
        bench.Strike.TRAINER}


def test_a_schedule_with_a_meaningless_mtbf_or_share_is_refused():
    with pytest.raises(ValueError, match="mtbf_s must be above 0"):
        bench.failure_schedule(0, 0.0, 100.0, 0.5)
    with pytest.raises(ValueError, match="worker_share in"):
        bench.failure_schedule(0, 10.0, 100.0, 1.5)


def test_the_young_daly_prediction_is_one_minus_stall_rework_and_restart_shares():
    # C = 1 s, MTBF = 200 s: T = sqrt(2 * 1 * 200) = 20 s; R = 10 s.
    t = bench.young_daly(1.0, 200.0)
    assert t == pytest.approx(20.0)
    assert bench.predicted_goodput(1.0, t, 200.0, 10.0) == pytest.approx(1 - 0.05 - 0.05 - 0.05)
    # T = sqrt(2 C MTBF) is where the prediction peaks.
    best = bench.predicted_goodput(1.0, t, 200.0, 10.0)
    for other in (t / 2, t * 0.9, t * 1.1, t * 2):
        assert bench.predicted_goodput(1.0, other, 200.0, 10.0) < best


def test_the_restart_from_zero_expectation_matches_a_seeded_simulation():
    job, mtbf, restart = 100.0, 80.0, 5.0
    rng, walls = random.Random(3), []
    for _ in range(20000):
        wall = 0.0
        while True:
            fail = rng.expovariate(1.0 / mtbf)
            if fail >= job:
                walls.append(wall + job)
                break
            wall += fail + restart
    want = bench.restart_from_zero_wall(job, mtbf, restart)
    assert want == pytest.approx((mtbf + restart) * (math.exp(job / mtbf) - 1))
    assert statistics.mean(walls) == pytest.approx(want, rel=0.03)
