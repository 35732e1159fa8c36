"""A trainer that dies while its run worker lives is relaunched in the same Dagster run, by
the one failure policy and budget the sensors use (`ckpt_assets.attempt.in_run`). On by default: the
end-to-end tests here set nothing."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from ckpt_assets.attempt.in_run import (
    relaunch_decision,
    serve_backoff,
    settle_after_preemption,
)
from ckpt_assets.attempt.process import PROCESS_STARTED, WARM_STARTED
from ckpt_assets.attempt.warm_start import STANDBY_STARTED
from ckpt_assets.base.attempt_processes import AttemptProcesses
from ckpt_assets.base.end import AttemptEnd
from ckpt_assets.base.events import ATTEMPT_ENDED, partition_events
from ckpt_assets.base.tags import (
    TAG_ATTEMPT,
    TAG_BUDGET,
    TAG_DECISION,
    TAG_PARENT_RUN_ID,
)
from ckpt_assets.definitions import make_resources
from ckpt_assets.lifecycle.policy import Budget, PolicyConfig, decide
from ckpt_assets.lifecycle.settings import ResumeSettings, Setting
from ckpt_assets.lifecycle.state import State, run_state
from ckpt_assets.records.lineage import format_lineage, lineage_report
from tests.daemon_harness import Daemon, baseline_config, kill
from tests.daemon_harness import training_config as training_config_e2e
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import (
    TrainerKiller,
    materialize_run,
    step_failure_metadata,
    training_config,
)
from tests.polling import pid_alive, wait_for
from tests.trainer_proc import assert_bitwise_equal, final_state, training_state
from trainer.base.outcomes import Outcome
from trainer.storage import open_store

ON = ResumeSettings()
OFF = ResumeSettings(in_run_relaunch=False)
FRESH = Budget()


def _ended(outcome: Outcome, step: int | None = 10, attempt: int = 1) -> AttemptEnd:
    return AttemptEnd(outcome, "r", exit_code=outcome.exit_code or -9, attempt=attempt,
                      last_committed_step=step)


def _relaunch(ended: AttemptEnd, used: Budget = FRESH, settings: ResumeSettings = ON,
              **kw):
    return relaunch_decision(ended, used, settings, interrupted=kw.get("interrupted", False),
                             stop_requested=kw.get("stop_requested", False))


@pytest.mark.parametrize("outcome", [Outcome.KILLED_BY_SIGNAL, Outcome.RANK_LOST])
def test_a_killed_trainer_is_relaunched_by_the_policys_own_decision_and_budget(outcome):
    ended = _ended(outcome)
    got = _relaunch(ended)
    assert got == decide(ended, Budget(), ON.policy)
    assert got.resume and got.delay_s == 0
    assert got.budget.transient == 0 and got.budget.failures == 1  # after progress: free


@pytest.mark.parametrize("outcome", [Outcome.USER_CODE_ERROR, Outcome.BAD_INPUT,
                                     Outcome.DIVERGED, Outcome.CHECKPOINT_UNLOADABLE,
                                     Outcome.SUPERSEDED, Outcome.UNFINISHED])
def test_what_the_policy_never_resumes_is_never_relaunched(outcome):
    assert _relaunch(_ended(outcome)) is None


def test_a_trainer_sigtermed_alone_is_relaunched_within_the_preemption_budget():
    ended = _ended(Outcome.PREEMPTED)
    got = _relaunch(ended)
    assert got == decide(ended, Budget(), ON.policy)
    assert got.budget.preemptions == 1 and got.budget.transient == 0
    cfg = ResumeSettings(policy=PolicyConfig(max_preemptions=1))
    # Preempted again before it committed anything new: over that budget of 1.
    assert _relaunch(_ended(Outcome.PREEMPTED, 10, 2), got.budget, cfg) is None
    # A preempted trainer whose run worker is stopping too: the sensors' (below, end to end).
    assert _relaunch(ended, interrupted=True) is None


def test_the_settle_after_a_preemption_ends_at_the_run_workers_own_interrupt_or_its_bound():
    now = [0.0]
    heard = iter([False, False, True])
    assert settle_after_preemption(ON, lambda: next(heard), lambda: now[0],
                                   lambda s: now.__setitem__(0, now[0] + s))
    assert now[0] < ON.in_run_preempt_settle_s
    now = [0.0]
    assert not settle_after_preemption(ON, lambda: False, lambda: now[0],
                                       lambda s: now.__setitem__(0, now[0] + s))
    assert now[0] >= ON.in_run_preempt_settle_s


def test_a_used_up_budget_is_not_relaunched_in_run_either():
    cfg = ResumeSettings(policy=PolicyConfig(max_transient=0))
    first = _relaunch(_ended(Outcome.KILLED_BY_SIGNAL), settings=cfg)  # after progress
    assert first is not None
    assert _relaunch(_ended(Outcome.KILLED_BY_SIGNAL, 10, 2), first.budget, cfg) is None


def test_a_back_off_longer_than_the_in_run_bound_is_left_to_the_reconciler():
    used = Budget(resumed_from_step=10, high_step=10, failures=1)
    ended = _ended(Outcome.STORAGE_UNAVAILABLE, 10, 2)  # again at step 10: a back-off
    assert decide(ended, used).delay_s == 10.0
    short = ResumeSettings(in_run_max_delay_s=5.0)
    assert _relaunch(ended, used, short) is None
    assert _relaunch(ended, used).delay_s == 10.0


def test_an_interrupted_or_stopped_run_or_a_disabled_setting_is_not_relaunched():
    ended = _ended(Outcome.KILLED_BY_SIGNAL)
    assert _relaunch(ended, interrupted=True) is None
    assert _relaunch(ended, stop_requested=True) is None
    assert _relaunch(ended, settings=OFF) is None


def test_a_trainer_the_reconciler_judged_and_stopped_is_left_to_the_sensors():
    ended = _ended(Outcome.KILLED_BY_SIGNAL)
    assert relaunch_decision(ended, FRESH, ON, interrupted=False, stop_requested=False,
                             taken_over=True) is None


def test_in_run_relaunch_is_on_unless_the_environment_turns_it_off(monkeypatch):
    monkeypatch.delenv(Setting.IN_RUN_RELAUNCH, raising=False)
    assert ResumeSettings.from_env().in_run_relaunch
    monkeypatch.setenv(Setting.IN_RUN_RELAUNCH, "0")
    monkeypatch.setenv(Setting.IN_RUN_MAX_DELAY_S, "7")
    s = ResumeSettings.from_env()
    assert not s.in_run_relaunch and s.in_run_max_delay_s == 7.0
    monkeypatch.setenv(Setting.IN_RUN_RELAUNCH, " On ")
    assert ResumeSettings.from_env().in_run_relaunch


def test_a_setting_that_is_neither_on_nor_off_is_refused_with_the_words_that_work(monkeypatch):
    monkeypatch.setenv(Setting.IN_RUN_RELAUNCH, "sometimes")
    with pytest.raises(ValueError, match="CKPT_IN_RUN_RELAUNCH='sometimes' is neither on nor "
                                         "off: set it to one of 1, true"):
        ResumeSettings.from_env()


def test_a_back_off_is_slept_out_and_an_immediate_relaunch_does_not_sleep():
    slept = []
    serve_backoff(_relaunch(_ended(Outcome.KILLED_BY_SIGNAL)), slept.append)
    used = Budget(resumed_from_step=10, high_step=10, failures=1)
    serve_backoff(_relaunch(_ended(Outcome.KILLED_BY_SIGNAL, 10, 2), used), slept.append)
    assert slept == [10.0]


# -- end to end: real trainer processes, in-process materialize ----------------------------

def _started(instance, run_id: str) -> list[str]:
    """The run's log lines that say an attempt's process started."""
    return [r.user_message for r in instance.all_logs(run_id)
            if r.user_message.startswith(PROCESS_STARTED)]


SETTLING = "for a stop of the worker's own before it is relaunched in this run"


def _said(instance, run_id: str, words: str) -> bool:
    return bool(_said_all(instance, run_id, words))


def _said_all(instance, run_id: str, words: str) -> list[str]:
    return [r.user_message for r in instance.all_logs(run_id)
            if words in (r.user_message or "")]


def _ends(instance, key: str) -> list[dict]:
    return [md for md, _ in partition_events(instance, key, ATTEMPT_ENDED)]


@pytest.mark.slow
@pytest.mark.warm_standby
def test_a_trainer_killed_once_is_relaunched_as_attempt_2_and_ends_bitwise_identical(
        instance, tmp_path, mlflow_uri, monkeypatch):
    monkeypatch.delenv(Setting.IN_RUN_RELAUNCH, raising=False)  # the default
    store = tmp_path / "store"
    res = make_resources(str(store), tracking_uri=mlflow_uri)
    killed = materialize_run(instance, "killed", res, training=training_config(
        task="tests.user_tasks:crash_once",
        # Attempt 1 dies once the standby for attempt 2 is there (it starts when attempt 1
        # has spoken, which on a busy machine can take longer than its first 15 steps).
        task_args={"crash_once_at": 15, "crash_marker": str(tmp_path / "crashed"),
                   "crash_after_standby": True, "step_delay": 0.1}))
    assert killed.success and (tmp_path / "crashed").exists()
    first, second = _ends(instance, "killed")
    assert first["failure_class"] == "killed_by_signal" and first["attempt"] == 1
    assert second["failure_class"] == "success" and second["attempt"] == 2
    assert second["resumed_from_step"] == first["last_committed_step"] == 10
    assert first["dagster_run_id"] == second["dagster_run_id"] == killed.run_id
    # Attempt 1 was the standby the run's first step started; attempt 2 the one that
    # imported torch while attempt 1 trained.
    assert [WARM_STARTED in line for line in _started(instance, killed.run_id)] == [True, True]
    run = instance.get_run_by_id(killed.run_id)
    assert Budget.from_tag(run.tags[TAG_BUDGET]).failures == 1
    # MLflow: the training run's one MLflow run carries each attempt's tags.
    tags = MlflowClient(tracking_uri=mlflow_uri).get_run(second["mlflow_run_id"]).data.tags
    assert tags["attempt_1.failure_class"] == "killed_by_signal"
    assert tags["attempt_2.start"] == "resumed" and tags["attempt_2.resumed_from_step"] == "10"
    rep = lineage_report(instance, open_store(str(store)), "killed")
    assert [(a["attempt"], a["failure_class"]) for a in rep["attempts"]] == [
        (1, "killed_by_signal"), (2, "success")]
    assert "resumed from step 10" in format_lineage(rep)
    assert {c["attempt"] for c in rep["checkpoints"]} == {1, 2}
    # Interrupted once, whichever way it came back: the state (the list's row and the state
    # check read it) counts the relaunched attempt as an interrupted one.
    finished = run_state(instance, "killed")
    assert finished.state == State.FINISHED
    assert "attempt 2 finished the run, after 1 interrupted attempt(s)" in finished.detail
    plain = materialize_run(instance, "plain", res, training=training_config())
    assert plain.success
    assert_bitwise_equal(final_state(store, run="plain"), final_state(store, run="killed"))


@pytest.mark.slow
def test_a_bug_in_the_training_code_is_never_relaunched(instance, tmp_path, mlflow_uri,
                                                        monkeypatch):
    monkeypatch.delenv(Setting.IN_RUN_RELAUNCH, raising=False)  # the default
    res = make_resources(str(tmp_path / "store"), tracking_uri=mlflow_uri)
    out = materialize_run(instance, "bug", res,
                          training=training_config(task_args={"fail_at_step": 15}))
    assert not out.success
    _, md = step_failure_metadata(out)
    assert md["attempt"] == 1 and md["failure_class"] == "user_code_error"
    assert [e["attempt"] for e in _ends(instance, "bug")] == [1]


@pytest.mark.slow
@pytest.mark.warm_standby
def test_a_runs_first_attempt_is_relaunched_from_its_standby_though_the_worker_set_torch_variables(
        instance, tmp_path, mlflow_uri, monkeypatch):
    """In a fresh run worker, the end-of-run imports that start once attempt 1 reported a
    step in the last tenth of its steps (here it crashes at step 39 of 40) may change the
    worker's environment (torch._dynamo, imported where a task's `build` builds its
    optimizer, sets TORCHINDUCTOR_CACHE_DIR, a variable torch reads at start). Attempt 2
    inherits the worker's environment as the run began, as attempt 1 and its standby did:
    the standby fits, and the run's first relaunch is warm."""
    import ckpt_assets.defs.assets as assets

    monkeypatch.delenv(Setting.IN_RUN_RELAUNCH, raising=False)  # the default
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    # What such an import does to a fresh worker's environment (in this test process
    # torch._dynamo was imported long ago, and the prefetch runs once per process).
    monkeypatch.setattr(assets, "prefetch_end_of_run_imports", lambda evaluates: monkeypatch.setenv(
        "TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor")))
    res = make_resources(str(tmp_path / "store"), tracking_uri=mlflow_uri)
    out = materialize_run(instance, "warm-first", res, training=training_config(
        task="tests.user_tasks:crash_once",
        task_args={"crash_once_at": 39, "crash_marker": str(tmp_path / "crashed"),
                   "crash_after_standby": True, "step_delay": 0.1}))
    assert out.success and (tmp_path / "crashed").exists()
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "attempt 1 ended before the prefetch"
    assert [e["attempt"] for e in _ends(instance, "warm-first")] == [1, 2]
    started = _started(instance, out.run_id)
    assert len(started) == 2 and all(WARM_STARTED in line for line in started), started


@pytest.mark.slow
def test_a_trainer_sigtermed_alone_is_relaunched_in_its_run_as_attempt_2(
        instance, tmp_path, mlflow_uri, monkeypatch):
    """Only the trainer is signalled (its pod deleted, its run worker's pod on another
    node): the worker hears nothing while it settles, and the next attempt trains on in
    the same Dagster run, on the preemption budget."""
    monkeypatch.delenv(Setting.IN_RUN_RELAUNCH, raising=False)  # the default
    store = tmp_path / "store"
    res = make_resources(str(store), tracking_uri=mlflow_uri)
    instance.add_dynamic_partitions("training_runs", ["sigtermed"])
    killer = TrainerKiller(store, "default", "sigtermed", at_step=10, sig=signal.SIGTERM)
    killer.start()
    out = materialize_run(instance, "sigtermed", res,
                          training=training_config(task_args={"step_delay": 0.05}))
    killer.cancel()
    assert killer.killed_pid and out.success
    first, second = _ends(instance, "sigtermed")
    assert (first["attempt"], first["failure_class"], first["exit_code"]) == (1, "preempted", 143)
    assert (second["attempt"], second["failure_class"]) == (2, "success")
    assert first["dagster_run_id"] == second["dagster_run_id"] == out.run_id
    assert second["resumed_from_step"] == first["last_committed_step"] >= 10
    assert Budget.from_tag(instance.get_run_by_id(out.run_id).tags[TAG_BUDGET]).preemptions == 1


# -- end to end under a real dagster-daemon, default settings ------------------------------

@pytest.fixture(scope="module")
def shipped_daemon(tmp_path_factory):
    """One daemon with the shipped settings (in-run relaunch on, the warm standby on) for
    this module's two end-to-end tests; each trains a partition of its own."""
    work = tmp_path_factory.mktemp("shipped")
    with pytest.MonkeyPatch.context() as env:  # the daemon inherits these
        env.delenv(Setting.IN_RUN_RELAUNCH, raising=False)
        env.delenv(Setting.WARM_TRAINER, raising=False)
        daemon = Daemon.start(work / "d", str(work / "store"))
    yield daemon
    daemon.stop()


@pytest.mark.slow
@pytest.mark.warm_standby
def test_a_trainer_sigkilled_under_the_daemon_trains_on_in_its_run_as_attempt_2(
        tmp_path, shipped_daemon, uninterrupted):
    """The default path for the commonest failure: the trainer's process is SIGKILLed from
    outside while its run worker lives. No failed run, no sensor decision, no second run:
    one run, two attempts in its lineage, one transient failure on its budget, and the
    state of a run that was never interrupted."""

    daemon = shipped_daemon
    # Attempt 1 waits after step 15 until it is killed (the toy task's `pause_after_step`): on
    # a busy machine, waiting below for the relaunch's standby took longer than the rest of
    # its 60 steps, which then ended the run before the kill.
    in_run = training_config_e2e("in-run")
    in_run["task_args"]["pause_after_step"] = 15
    daemon.launch("in-run", in_run, tmp_path)
    hb = daemon.wait_for_step("in-run", 15, attempt=1)
    # The relaunch's standby starts once attempt 1 has spoken (the first was attempt
    # 1's own); a trainer killed before that is relaunched cold, a busy machine's case.
    run_id = daemon.runs("in-run")[0].run_id
    wait_for(lambda: len(_said_all(daemon.instance, run_id, STANDBY_STARTED)) >= 2, 120,
             what="the standby for a relaunch")
    kill(hb["pid"], signal.SIGKILL)
    final = daemon.wait_done("in-run")
    assert [r.run_id for r in daemon.runs("in-run")] == [final.run_id]
    assert TAG_DECISION not in final.tags and final.tags[TAG_ATTEMPT] == "2"
    # Attempt 2 was the standby started beside attempt 1, though this fresh run worker
    # imported torch meanwhile (its end-of-run imports).
    started = _started(daemon.instance, final.run_id)
    assert len(started) == 2 and all(WARM_STARTED in line for line in started), started
    assert Budget.from_tag(final.tags[TAG_BUDGET]).failures == 1
    rep = lineage_report(daemon.instance, open_store(daemon.store), "in-run")
    assert [(a["attempt"], a["failure_class"]) for a in rep["attempts"]] == [
        (1, "killed_by_signal"), (2, "success")]
    assert daemon.max_active["in-run"] == 1
    assert_bitwise_equal(uninterrupted(baseline_config()), training_state(
        final_state(Path(daemon.store), run="in-run")))


@pytest.mark.slow
def test_an_attempt_relaunched_in_its_run_reads_one_name_in_every_view_and_counts_as_interrupted(
        tmp_path, shipped_daemon):
    """Attempt 1, SIGKILLed and relaunched in its run, is `killed_by_signal` in all six
    views; `list` and the check, showing the run finished by attempt 2, name and count it."""
    from ckpt_assets.records.listing import run_summary

    daemon, name = shipped_daemon, "in-run-named"
    cfg = training_config_e2e(name, max_steps=20)  # attempt 1 commits step 10, holds at 12
    cfg["task_args"] = {**cfg["task_args"], "step_delay": 0, "pause_after_step": 12}
    daemon.launch(name, cfg, tmp_path)
    kill(daemon.wait_for_step(name, 12, attempt=1)["pid"], signal.SIGKILL)
    final = daemon.wait_done(name)
    assert [r.run_id for r in daemon.runs(name)] == [final.run_id]
    names = daemon.outcome_names(name, final.run_id, attempt=1)
    assert set(names.values()) == {"killed_by_signal"}, names
    detail = run_state(daemon.instance, name).detail
    assert detail == ("attempt 2 finished the run, after 1 interrupted attempt(s); attempt 1 "
                      "ended killed_by_signal"), detail
    assert run_summary(daemon.instance, open_store(daemon.store), name)["detail"] == detail


@pytest.mark.slow
def test_a_trainer_whose_run_worker_is_sigtermed_too_is_left_to_the_sensors(tmp_path,
                                                                            shipped_daemon):
    """The whole pod or node is going: the trainer is signalled, and its run worker moments
    after the trainer has committed and exited. The worker's own interrupt ends the settle:
    nothing is relaunched in its run, which ends, and the sensors resume it as a new run."""
    daemon = shipped_daemon
    daemon.launch("node-going", training_config_e2e("node-going"), tmp_path)
    hb = daemon.wait_for_step("node-going", 15, attempt=1)
    (run,) = daemon.runs("node-going")
    worker = AttemptProcesses.of_run(daemon.instance.get_run_by_id(run.run_id)).worker.pid
    kill(hb["pid"], signal.SIGTERM)
    # The trainer has committed and exited, and the step waits for a stop of its own.
    daemon.wait_until(lambda: _said(daemon.instance, run.run_id, SETTLING),
                      "the step to settle", every=0.05)
    assert not pid_alive(hb["pid"])
    kill(worker, signal.SIGTERM)
    final = daemon.wait_done("node-going")
    first, resume = daemon.runs("node-going")
    assert final.run_id == resume.run_id and resume.tags[TAG_PARENT_RUN_ID] == first.run_id
    # (A relaunch would have tagged the run with attempt 2.)
    assert first.status.value in ("FAILURE", "CANCELED")
    assert first.tags.get(TAG_ATTEMPT, "1") == "1"
    assert resume.tags[TAG_ATTEMPT] == "2"
    # The first run's only attempt; none was relaunched beside the stopping worker.
    assert [e["attempt"] for e in _ends(daemon.instance, "node-going")
            if e["dagster_run_id"] == first.run_id] == [1]
    assert not _said(daemon.instance, first.run_id, "relaunching the trainer in this run")
    assert daemon.max_active["node-going"] == 1
