"""How often the daemon evaluates our sensors, decided by Dagster's own skip rule.

The daemon's sensor loop runs every `MIN_INTERVAL_LOOP_TIME` seconds at most, and skips a
sensor whose last tick started less than its minimum interval ago (`is_under_min_interval`).
A tick starts a little after its loop does, so a minimum interval equal to the loop's period
skipped every other loop: a failure waited up to 10 s for its resume, not 5.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from dagster._core.scheduler.instigation import SensorInstigatorData
from dagster._daemon.sensor import MIN_INTERVAL_LOOP_TIME, is_under_min_interval

from ckpt_assets.definitions import defs
from ckpt_assets.defs.sensors import DAEMON_LOOP_S

LAG_S = 0.25  # how far into its loop the previous tick started (a busy daemon's worst, roughly)


def _skipped_at_next_loop(min_interval: float) -> bool:
    """Whether Dagster skips a sensor at the loop after one whose tick started LAG_S late."""
    started = time.time() - (MIN_INTERVAL_LOOP_TIME - LAG_S)
    state = SimpleNamespace(instigator_data=SensorInstigatorData(
        last_tick_start_timestamp=started, last_tick_timestamp=started))
    return is_under_min_interval(state, SimpleNamespace(min_interval_seconds=min_interval))


def test_our_loop_period_is_the_daemons():
    assert DAEMON_LOOP_S == MIN_INTERVAL_LOOP_TIME


def test_a_minimum_interval_equal_to_the_loop_period_would_skip_every_other_loop():
    assert _skipped_at_next_loop(MIN_INTERVAL_LOOP_TIME)


def test_every_sensor_of_the_code_location_is_evaluated_on_every_loop_of_the_daemon():
    sensors = list(defs.sensors)
    assert {s.name for s in sensors} >= {"resume_failed_training", "resume_terminated_training",
                                         "reconcile_training_runs", "check_succeeded_training"}
    for sensor in sensors:
        assert not _skipped_at_next_loop(sensor.minimum_interval_seconds), sensor.name
