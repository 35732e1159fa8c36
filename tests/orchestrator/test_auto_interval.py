"""`checkpoint.every_seconds: auto`: the interval follows the measured stall and the
experiment's failure history, and every checkpoint records the interval and its inputs."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import dagster as dg
import pytest
import torch

from ckpt_assets.attempt.command import attempt_mtbf
from ckpt_assets.base.registration import register_training_run
from ckpt_assets.base.tags import TAG_FAILURE_KIND, TAG_NO_RESUME
from ckpt_assets.defs.resources import CheckpointStore
from ckpt_assets.lifecycle.failure_history import experiment_mtbf, failure_history
from ckpt_assets.lifecycle.state import RunState, State, state_observation
from tests.dagster_runs import lost_worker_run, started_run
from trainer import CheckpointSession
from trainer.base.errors import ConfigError
from trainer.base.interval import ASSUMED_STALL_S, AutoInterval, Mtbf, MtbfSource, young_daly
from trainer.base.outcomes import Kind
from trainer.config import CheckpointConfig, config_from_dict, parse
from trainer.process.contract import LaunchEnv

HOUR = 3600.0


def test_more_failures_in_the_same_training_time_give_a_shorter_interval():
    intervals = []
    for failures in (1, 2, 8):
        auto = AutoInterval(Mtbf(100 * HOUR / failures, MtbfSource.HISTORY, failures))
        auto.observe(0.05, write_s=1.0)
        intervals.append(auto.every_seconds)
    assert intervals == sorted(intervals, reverse=True) and len(set(intervals)) == 3
    assert intervals[0] == pytest.approx(math.sqrt(2 * 0.05 * 100 * HOUR), rel=1e-3)


def test_the_interval_follows_the_stalls_measured_and_never_undercuts_the_last_write():
    auto = AutoInterval(Mtbf(HOUR))
    assert not auto.choice.stall_measured
    assert auto.every_seconds == pytest.approx(young_daly(ASSUMED_STALL_S, HOUR), rel=1e-3)
    auto.observe(0.01, write_s=0.5)
    short = auto.every_seconds
    for _ in range(5):
        auto.observe(0.5, write_s=0.5)
    assert auto.choice.stall_measured and auto.every_seconds > short
    auto.observe(0.0, write_s=30.0)  # writes slower than Young/Daly's interval
    assert auto.every_seconds >= 30.0 and auto.choice.write_seconds == 30.0


def test_every_seconds_takes_a_positive_number_auto_or_null_and_refuses_the_rest():
    assert parse(CheckpointConfig, {"every_seconds": "auto"}).every_seconds == "auto"
    assert parse(CheckpointConfig, {"every_seconds": 30}).every_seconds == 30.0
    assert parse(CheckpointConfig, {"every_seconds": None}).every_seconds is None
    for bad in (0, -5, "fast", "30", True, float("inf")):
        with pytest.raises(ConfigError, match="every_seconds' must be a number of seconds"):
            config_from_dict({"checkpoint": {"every_seconds": bad}})
    with pytest.raises(ConfigError, match="mtbf_seconds' must be positive"):
        config_from_dict({"checkpoint": {"mtbf_seconds": 0}})


def test_a_config_that_gives_only_the_mtbf_gets_the_interval_that_sets_itself():
    assert parse(CheckpointConfig, {"mtbf_seconds": 120}).every_seconds == "auto"
    assert parse(CheckpointConfig, {"mtbf_seconds": 120, "every_seconds": 30}).every_seconds == 30
    assert parse(CheckpointConfig, {"mtbf_seconds": 120, "every_seconds": None}).every_seconds \
        is None  # said explicitly: off
    assert parse(CheckpointConfig, {}).every_seconds is None  # the default: steps only
    # The registered config (every key written out) reads back the same.
    once = config_from_dict({"checkpoint": {"mtbf_seconds": 120}})
    assert config_from_dict(once.model_dump()).checkpoint == once.checkpoint


def _train(ckpt: CheckpointSession, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt.restore(model=model, optimizer=opt)
    for step in range(1, steps + 1):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        ckpt.step(step, loss=1.0)


def _intervals(ckpt: CheckpointSession) -> list[dict]:
    repo = ckpt.repo
    return [repo.read_manifest(n).meta["interval"] for n in repo.committed()]


def test_standalone_the_interval_uses_the_configs_mtbf_and_each_checkpoint_records_it(tmp_path):
    # Synchronous saves (the default): each commit, and so its stall, is known before the
    # next trigger.
    with CheckpointSession(run="r", store=str(tmp_path), resume="never", max_steps=6,
                           every_steps=3, every_seconds="auto", mtbf_seconds=2 * HOUR,
                           install_signals=False, on_best=False) as ckpt:
        _train(ckpt, 6)
    first, second = _intervals(ckpt)
    assert first["mtbf_seconds"] == 2 * HOUR and first["mtbf_source"] == "config"
    assert not first["stall_measured"] and first["stall_seconds"] == ASSUMED_STALL_S
    # The second interval was recomputed from the first save's measured stall.
    assert second["stall_measured"]
    assert second["every_seconds"] == pytest.approx(
        max(young_daly(second["stall_seconds"], 2 * HOUR), second["write_seconds"]), abs=1e-3)


def test_launched_by_the_orchestrator_the_interval_uses_the_mtbf_it_was_told(
        tmp_path, monkeypatch):
    told = Mtbf(900.0, MtbfSource.HISTORY, failures=4, observed_seconds=3600.0)
    launch = LaunchEnv(run="r", experiment="exp", store_uri=str(tmp_path), attempt=1,
                       mtbf=told, exit_with_parent=False)
    assert LaunchEnv.from_env(launch.to_env()) == launch
    for name, value in launch.to_env().items():
        monkeypatch.setenv(name, value)
    with CheckpointSession(max_steps=2, every_seconds="auto", async_save=True,
                           install_signals=False, on_best=False) as ckpt:
        _train(ckpt, 2)
    (recorded,) = _intervals(ckpt)
    assert recorded["mtbf_seconds"] == 900.0 and recorded["mtbf_source"] == "history"
    assert recorded["mtbf_failures"] == 4


# -- the orchestrator's side: the experiment's MTBF from the instance's runs ---------------

def _ended(instance, partition: str, hours: float, kind: Kind | None,
           status=dg.DagsterRunStatus.FAILURE, tags: dict | None = None) -> dg.DagsterRun:
    """An attempt of `partition` that trained `hours` and ended in `status`, decided as
    `kind` by the resume sensors (None: not decided yet)."""
    decided = {TAG_FAILURE_KIND: kind.value} if kind else {}
    run = started_run(instance, partition, started_ago=hours * HOUR, tags={**decided,
                                                                          **(tags or {})})
    if status == dg.DagsterRunStatus.SUCCESS:
        instance.report_dagster_event(dg.DagsterEvent(
            dg.DagsterEventType.RUN_SUCCESS.value, job_name=run.job_name), run.run_id)
    elif status == dg.DagsterRunStatus.CANCELED:
        instance.report_run_canceled(run, "terminated")
    else:
        instance.report_run_failed(run, "failed")
    return instance.get_run_by_id(run.run_id)


@pytest.fixture
def store(tmp_path):
    store = CheckpointStore(uri=str(tmp_path / "store")).open()
    for run, experiment in (("a", "exp"), ("b", "exp"), ("other", "elsewhere")):
        register_training_run(store, run, {"experiment": experiment, "max_steps": 10})
    return store


def test_the_orchestrators_mtbf_counts_the_experiments_interruptions_over_its_training_time(
        store):
    with dg.DagsterInstance.ephemeral() as instance:
        assert experiment_mtbf(instance, store, "exp", 6 * HOUR) == Mtbf(
            6 * HOUR, MtbfSource.CONFIG, 0, 0.0)
        _ended(instance, "a", 2, None, dg.DagsterRunStatus.SUCCESS)
        _ended(instance, "b", 1, Kind.BUG)  # ends the run: no interval would have helped
        _ended(instance, "a", 1, Kind.STOPPED_BY_USER, dg.DagsterRunStatus.CANCELED,
               tags={TAG_NO_RESUME: "true"})
        _ended(instance, "other", 5, Kind.PREEMPTED)  # another experiment
        quiet = experiment_mtbf(instance, store, "exp", 6 * HOUR)
        assert quiet.source == MtbfSource.CONFIG and quiet.seconds == 6 * HOUR
        assert quiet.observed_seconds == pytest.approx(4 * HOUR, abs=60)

        _ended(instance, "a", 2, Kind.PREEMPTED)
        one = experiment_mtbf(instance, store, "exp", 6 * HOUR)
        assert (one.source, one.failures) == (MtbfSource.HISTORY, 1)
        assert one.seconds == pytest.approx(6 * HOUR, abs=60)

        _ended(instance, "b", 1, Kind.STORAGE)
        lost_worker_run(instance, "b")  # killed, and not decided on yet: counted all the same
        more = experiment_mtbf(instance, store, "exp", 6 * HOUR)
        assert more.failures == 3 and more.seconds == pytest.approx(7 * HOUR / 3, abs=60)

        intervals = [AutoInterval(m) for m in (quiet, one, more)]
        for auto in intervals:
            auto.observe(0.02, write_s=2.0)
        assert intervals[0].every_seconds == intervals[1].every_seconds  # 6 h either way
        assert intervals[2].every_seconds < intervals[1].every_seconds


def test_a_trainer_relaunched_inside_its_dagster_run_is_a_failure_of_the_history(store):
    with dg.DagsterInstance.ephemeral() as instance:
        _ended(instance, "a", 2, None, dg.DagsterRunStatus.SUCCESS)
        for kind in (Kind.KILLED, Kind.PREEMPTED, Kind.BUG):  # a bug is never relaunched
            relaunch = RunState("a", State.TRAINING, "relaunched", "r1", 2)
            instance.report_runless_asset_event(state_observation(
                relaunch, {"relaunched_in_run": True, "failure_kind": kind.value}))
        history = failure_history(instance, ["a"])
        assert (history.attempts, history.failures) == (3, 2)
        assert history.mtbf(6 * HOUR).seconds == pytest.approx(HOUR, abs=60)


def test_an_attempt_is_told_the_mtbf_only_when_its_interval_may_set_itself(store, tmp_path):
    log = logging.getLogger("test")
    with dg.DagsterInstance.ephemeral() as instance:
        _ended(instance, "a", 1, Kind.KILLED)
        current = started_run(instance, "a")
        history = failure_history(instance, ["a"], exclude_run_id=current.run_id)
        assert (history.attempts, history.failures) == (1, 1)

        context = SimpleNamespace(instance=instance, run=current, log=log)  # the asset's
        fixed = register_training_run(store, "fixed", {"experiment": "exp"})
        assert attempt_mtbf(context, store, fixed) is None
        auto = register_training_run(store, "auto-run", {
            "experiment": "exp", "checkpoint": {"every_seconds": "auto"}})
        told = attempt_mtbf(context, store, auto)
        assert told.source == MtbfSource.HISTORY and told.failures == 1
        assert told.seconds == pytest.approx(HOUR, abs=60)
        command = register_training_run(store, "cmd", {
            "experiment": "exp", "command": ["python", "train.py"]})
        assert attempt_mtbf(context, store, command) == told


@pytest.mark.parametrize("every", ["auto", 300, 2.5, None])
def test_the_launch_form_takes_seconds_or_auto_and_registers_them_as_a_file_would(every):
    from ckpt_assets.base.registration import normalize_training_config
    from ckpt_assets.definitions import defs
    from ckpt_assets.defs.jobs import JOBS
    from ckpt_assets.runs.launch_form import training_from_form
    from ckpt_assets.runs.training_run import TrainingRunConfig

    job = dg.Definitions(assets=defs.assets, resources=defs.resources,
                         jobs=JOBS).resolve_job_def("train_job")
    given = {"checkpoint": {"every_seconds": every, "mtbf_seconds": HOUR}}
    resolved = dg.validate_run_config(
        job, {"ops": {"training_dataset": {"config": {"training": given}}}})
    form = TrainingRunConfig(**resolved["ops"]["training_dataset"]["config"])
    registered = normalize_training_config(training_from_form(form.training), "form-run")
    assert registered == normalize_training_config(given, "form-run")
    assert registered.checkpoint.every_seconds == every


def test_a_word_other_than_auto_passes_the_form_and_is_refused_at_registration_by_key():
    from ckpt_assets.base.registration import normalize_training_config

    with pytest.raises(ConfigError, match="checkpoint.every_seconds' must be a number"):
        normalize_training_config({"checkpoint": {"every_seconds": "hourly"}}, "form-run")
