"""The one vocabulary of outcomes and the orchestrator <-> trainer contract, in milliseconds."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from ckpt_assets.attempt.messages import newest_progress_only
from trainer.base import errors
from trainer.base.errors import ConfigError, TrainerError
from trainer.base.outcomes import Kind, Outcome, Resume, outcome_table
from trainer.checkpoints.records import CheckpointRecord
from trainer.config import config_from_dict
from trainer.process.contract import (
    CONTRACT_NAMES,
    Env,
    Eval,
    Failed,
    Finished,
    LaunchEnv,
    Progress,
    Skipped,
    Started,
    Stopped,
    parse_message,
    to_message,
)

REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"


def test_the_reference_pages_outcome_table_is_the_vocabulary_itself():
    text = REFERENCE.read_text()
    table = text.split("<!-- outcomes -->\n", 1)[1].split("<!-- /outcomes -->", 1)[0]
    assert table.strip() == outcome_table().strip()


@pytest.mark.parametrize("rc,reported,outcome", [
    (0, None, Outcome.SUCCESS),
    (1, None, Outcome.USER_CODE_ERROR),
    (2, None, Outcome.BAD_INPUT),
    (3, None, Outcome.CHECKPOINT_UNLOADABLE),
    (4, None, Outcome.DIVERGED),
    (5, None, Outcome.STORAGE_UNAVAILABLE),
    (6, None, Outcome.SUPERSEDED),
    (143, None, Outcome.PREEMPTED),
    (130, None, Outcome.PREEMPTED),
    (-signal.SIGTERM, None, Outcome.PREEMPTED),
    (-signal.SIGINT, None, Outcome.PREEMPTED),
    (-signal.SIGKILL, None, Outcome.KILLED_BY_SIGNAL),
    (137, None, Outcome.KILLED_BY_SIGNAL),
    (-signal.SIGSEGV, None, Outcome.KILLED_BY_SIGNAL),
    (77, None, Outcome.UNKNOWN),
    (1, "storage_unavailable", Outcome.STORAGE_UNAVAILABLE),  # the trainer's report wins
    (1, "not-a-class", Outcome.USER_CODE_ERROR),
])
def test_an_exit_status_is_one_outcome(rc, reported, outcome):
    assert Outcome.of_exit(rc, reported) is outcome


def test_every_error_the_trainer_foresees_has_an_outcome_with_an_exit_code():
    classes = [c for c in vars(errors).values()
               if isinstance(c, type) and issubclass(c, TrainerError)]
    assert len(classes) >= 8
    for cls in classes:
        assert cls.outcome.exit_code not in (None, 0), cls
        assert cls("x").exit_code == cls.outcome.exit_code
        assert cls("x").failure_class == cls.outcome.value


def test_exit_codes_are_unique_and_only_four_kinds_are_ever_resumed():
    codes = [o.exit_code for o in Outcome if o.exit_code is not None]
    assert len(codes) == len(set(codes))
    resumed = {k for k in Kind if k.resumable}
    assert resumed == {Kind.PREEMPTED, Kind.KILLED, Kind.STORAGE, Kind.STALLED}
    assert Kind.PREEMPTED.resume is Resume.AT_ONCE
    assert all(k.advice for k in Kind)


def test_a_launch_env_survives_the_trip_through_the_environment():
    told = LaunchEnv("r1", "exp", "s3://b/p", attempt=3, dagster_run_id="d", root_run_id="root",
                     code_version="abc", heartbeat_seconds=2.5, dataset_uri="/data",
                     data_version="v1", resume_from="file:///x", exit_with_parent=True)
    env = told.to_env()
    assert set(env) <= CONTRACT_NAMES
    assert LaunchEnv.from_env(env) == told
    assert LaunchEnv.from_env({}) is None  # not launched by the orchestrator


def test_a_stale_contract_variable_never_reaches_a_launched_process():
    inherited = {Env.RUN.value: "victim", Env.RESUME_FROM.value: "file:///old", "PATH": "/bin",
                 "CHECKPOINT_PATH": "file:///older", "CKPT_SOAK_HOOK": "1"}
    assert LaunchEnv.scrubbed(inherited) == {"PATH": "/bin", "CKPT_SOAK_HOOK": "1"}


@pytest.mark.parametrize("env,word", [
    ({"env": {"CKPT_RUN": "victim"}}, "CKPT_RUN"),
    ({"env": {"CKPT_STORE_URI": "/elsewhere"}}, "CKPT_STORE_URI"),
    ({"env": {"DAGSTER_PIPES_CONTEXT": "x"}}, "DAGSTER_PIPES_CONTEXT"),
    ({"env": {"CKPT_ANYTHING_NEW": "1"}}, "CKPT_ANYTHING_NEW"),
    ({"resume_env": "CKPT_RUN"}, "CKPT_RUN"),
])
def test_a_config_that_sets_the_orchestrators_variables_is_refused_naming_the_key(env, word):
    with pytest.raises(ConfigError, match=word) as e:
        config_from_dict({"command": ["python", "train.py"], **env})
    assert e.value.exit_code == Outcome.BAD_INPUT.exit_code


def test_a_config_may_name_its_own_variables_and_the_resume_aliases():
    cfg = config_from_dict({"command": ["python", "t.py"], "env": {"MY_FLAG": "1"},
                            "resume_env": "CHECKPOINT_PATH"})
    assert cfg.env == {"MY_FLAG": "1"} and cfg.resume_env == "CHECKPOINT_PATH"


@pytest.mark.parametrize("message", [
    Started(2, 20, "file:///s/c", [Skipped("step-30", "bad sha")], 100, {"run": "r"}),
    Eval(10, {"loss": 0.5, "accuracy": 0.9}),
    Progress(11, 0.25),
    Stopped(12, "SIGTERM"),
    Finished(100, {"loss": 0.1}),
    Failed(2, "bad_input", "ConfigError", "bad key", None),
])
def test_every_pipes_message_reads_back_as_the_record_that_was_sent(message):
    assert parse_message(to_message(message)) == message


def test_a_checkpoint_message_reads_back_as_its_record_and_foreign_messages_are_ignored():
    rec = CheckpointRecord(name="step-000000010-a1", step=10, uri="file:///s/x", sha256="0" * 64,
                           size=1, attempt=1)
    assert parse_message(to_message(rec)) == rec
    assert parse_message({"type": "something-else"}) is None
    assert parse_message("text") is None


def test_of_a_batch_of_messages_only_the_newest_progress_is_handled_and_nothing_else_is_dropped():
    rec = CheckpointRecord(name="step-000000010-a1", step=10, uri="file:///s/x", sha256="0" * 64,
                           size=1, attempt=1)
    batch = [Progress(8, 0.3), Progress(9, 0.2), rec, Progress(10, 0.1), Eval(10, {"loss": 1.0}),
             Finished(10, {"loss": 1.0})]
    assert newest_progress_only(batch) == [rec, Progress(10, 0.1), Eval(10, {"loss": 1.0}),
                                           Finished(10, {"loss": 1.0})]
    assert newest_progress_only([Stopped(3, "SIGTERM")]) == [Stopped(3, "SIGTERM")]



def test_the_run_workers_end_of_run_imports_start_once_and_load_in_the_background(
        monkeypatch):
    import sys

    from ckpt_assets.attempt import prefetch

    # Light stand-ins: matplotlib's first import may build its font cache with a subprocess.
    monkeypatch.setattr(prefetch, "_thread", None)
    monkeypatch.setattr(prefetch, "END_OF_RUN_IMPORTS", ("json",))
    monkeypatch.setattr(prefetch, "EVALUATION_IMPORTS", ("colorsys",))
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    prefetch.prefetch_end_of_run_imports(evaluates=True)
    first = prefetch._thread
    prefetch.prefetch_end_of_run_imports(evaluates=False)
    assert prefetch._thread is first  # once per process, whoever asks again
    # Not a daemon: the interpreter waits for it at exit, never stopping it mid-import.
    assert not first.daemon
    first.join(60)
    assert not first.is_alive()
    assert "colorsys" in sys.modules  # the evaluation's imports, as asked first


def test_the_end_of_run_imports_wait_for_a_step_in_the_last_tenth_of_the_trainers_steps():
    """An attempt interrupted before its last tenth never loads what only a run's end
    needs; a trainer that does not say how many steps it trains loads it once it spoke."""
    from types import SimpleNamespace

    from ckpt_assets.attempt.messages import AttemptReport

    context = SimpleNamespace(log=SimpleNamespace(info=print, debug=print, warning=print))
    tracker = SimpleNamespace(on_started=lambda m: None)

    def report_of(*msgs) -> AttemptReport:
        report = AttemptReport("r", 1)
        report.handle(context, tracker, [to_message(m) for m in msgs])
        return report

    assert not report_of().near_its_end()  # it has not spoken
    assert not report_of(Started(1, max_steps=100), Progress(89)).near_its_end()
    assert report_of(Started(1, max_steps=100), Progress(90)).near_its_end()
    assert report_of(Started(2, resumed_from_step=95, max_steps=100)).near_its_end()
    assert report_of(Started(1)).near_its_end()  # max_steps unknown: once it spoke
