"""How an attempt that could not start, or that ended without a checkpoint, is classified:
in process, in milliseconds.

What the operating system answers when a process cannot start (no such command, no such
working directory, not executable) is put in Popen's place; everything after it is the
real code: `start_process`'s TrainerStartError, `model_checkpoint`'s bad_input failure through
`materialize()`, the record the resume sensor reads back, and the policy's decision. The
real processes behind the same classes run in tests/orchestrator/test_assets.py and
tests/orchestrator/test_any_job_dagster.py.
"""

from __future__ import annotations

import errno
import json
import os

import dagster as dg
import pytest

from ckpt_assets.attempt import process as trainer_process
from ckpt_assets.attempt.errors import TrainerStartError
from ckpt_assets.attempt.messages import AttemptReport, failure_description
from ckpt_assets.attempt.process import ProcessOutcome, start_process
from ckpt_assets.base.end import AttemptEnd, bad_input
from ckpt_assets.cli.main import main as cli_main
from ckpt_assets.definitions import make_resources
from ckpt_assets.lifecycle.policy import decide
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import materialize_run, step_failure_metadata, training_config
from trainer.base.outcomes import Outcome
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import open_store


def _os_refuses(error: type[OSError], code: int, on: str):
    """A Popen that fails the way the OS fails it: `error` about `on` (the command or cwd)."""
    def popen(argv, *args, cwd=None, **kwargs):
        name = argv[0] if on == "command" else cwd
        raise error(code, os.strerror(code), name)
    return popen


@pytest.mark.parametrize("error,code,on,says", [
    (FileNotFoundError, errno.ENOENT, "command",
     "command 'no-such-binary' does not exist; fix the run config's command"),
    (FileNotFoundError, errno.ENOENT, "cwd",
     "working directory '/no/such/dir' does not exist; fix the run config's cwd"),
    (PermissionError, errno.EACCES, "command",
     "cannot start 'no-such-binary' in /no/such/dir: Permission denied"),
    (NotADirectoryError, errno.ENOTDIR, "cwd",
     "cannot start 'no-such-binary' in /no/such/dir: Not a directory"),
])
def test_a_process_that_cannot_start_is_a_launch_error_that_says_what_to_fix(
        monkeypatch, tmp_path, error, code, on, says):
    monkeypatch.setattr(trainer_process.subprocess, "Popen", _os_refuses(error, code, on))
    with pytest.raises(TrainerStartError) as err:
        start_process(["no-such-binary", "--epochs", "3"], {}, "/no/such/dir", str(tmp_path / "out"))
    assert says in str(err.value)


def test_a_command_that_does_not_exist_fails_the_step_once_as_bad_input_never_resumed(
        instance, tmp_path, mlflow_uri, monkeypatch):
    monkeypatch.setattr(trainer_process.subprocess, "Popen",
                        _os_refuses(FileNotFoundError, errno.ENOENT, "command"))
    cfg = {"command": ["no-such-trainer-binary", "--epochs", "3"]}
    res = materialize_run(instance, "nocmd", make_resources(str(tmp_path / "s")), training=cfg)
    assert not res.success
    _, md = step_failure_metadata(res)
    ended = AttemptEnd.from_metadata(md)
    assert (ended.exit_code, ended.outcome) == (2, Outcome.BAD_INPUT)
    assert "'no-such-trainer-binary' does not exist" in ended.message
    assert not decide(ended).resume
    failed_steps = [e.step_key for e in res.all_events if e.event_type_value == "STEP_FAILURE"]
    assert failed_steps == ["model_checkpoint"]


EXITED_0 = ProcessOutcome(0, None, [])  # the main process exited 0 and left nothing running


class _Run:
    run_id = "run-1"


class _Context:
    run = _Run()


def test_a_process_that_exits_0_without_committing_is_no_checkpoint_and_never_resumed(tmp_path):
    repo = CheckpointRepo(open_store(str(tmp_path / "store")), "default", "nockpt")
    ended = AttemptReport("nockpt", 1).outcome(repo, EXITED_0, _Context())
    assert ended.outcome is Outcome.NO_CHECKPOINT
    assert (ended.exit_code, ended.last_committed_step, ended.checkpoint_uri) == (0, None, None)
    assert "CheckpointSession" in failure_description(ended)
    assert not decide(ended).resume


def test_a_process_that_exits_0_after_committing_its_final_checkpoint_is_a_success(tmp_path):
    repo = CheckpointRepo(open_store(str(tmp_path / "store")), "default", "done")
    repo.claim(None, at_least=1)
    pending = repo.begin(40, 1)
    with repo.write_file(pending, "state.pt") as w:
        w.write(b"state at step 40")
    repo.commit(pending, {"final": True})
    ended = AttemptReport("done", 1).outcome(repo, EXITED_0, _Context())
    assert ended.outcome is Outcome.SUCCESS and not ended.outcome.failed
    assert ended.last_committed_step == 40 and ended.checkpoint_uri.endswith("step-000000040-a1")


def test_a_launch_error_is_a_failure_the_sensor_reads_back_as_bad_input():
    failure = bad_input("command 'x' does not exist", "some-run", attempt=3)
    assert isinstance(failure, dg.Failure)
    ended = AttemptEnd.from_metadata({k: v.value for k, v in failure.metadata.items()})
    assert (ended.outcome, ended.exit_code, ended.attempt) == (Outcome.BAD_INPUT, 2, 3)
    assert ended.message == "command 'x' does not exist"


# -- `ckpt-assets launch`: what it refuses before it asks Dagster to launch anything ----------

def _launch_config(tmp_path) -> str:
    path = tmp_path / "train.json"
    path.write_text(json.dumps(training_config()))
    return str(path)


def test_launching_a_run_that_was_never_registered_says_to_pass_its_config(
        dagster_home, store_uri, capsys):
    assert cli_main(["launch", "not-registered"]) == 2
    err = capsys.readouterr().err.strip()
    assert "pass --config FILE the first time" in err and len(err.splitlines()) == 1


def test_a_launch_tag_that_is_not_key_equals_value_is_refused(dagster_home, store_uri, tmp_path,
                                                              capsys):
    assert cli_main(["launch", "tagged", "--config", _launch_config(tmp_path),
                     "--tag", "team"]) == 2
    assert "--tag 'team': expected KEY=VALUE" in capsys.readouterr().err
    assert not (tmp_path / "store").exists()
