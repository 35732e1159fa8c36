"""An attempt owns its processes, and a run is finished only by a final checkpoint.

* A command that forks and exits 0 is an `unfinished` attempt (never a success, never
  final_model), and nothing it started outlives the attempt.
* The death of the launching process commits the step in progress and exits 143, whatever
  the script prints; the attempt is then recorded as ended by whoever looks next.

The fast tests check the rules on real processes and small sessions; the slow ones run
the commands through Dagster (`materialize()` in process, and `dagster asset materialize`
as a subprocess that is SIGKILLed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import dagster as dg
import pytest
import torch

from ckpt_assets.attempt.messages import AttemptReport, exit_outcome
from ckpt_assets.attempt.process import (
    Attempt,
    hand_on_messages,
    leftover_output,
    output_prefix,
    start_process,
)
from ckpt_assets.base.attempt_processes import AttemptProcesses
from ckpt_assets.base.child_start import stoppable, stops_held
from ckpt_assets.base.end import AttemptEnd
from ckpt_assets.base.process_group import group_members, stop_group
from ckpt_assets.base.tags import TAG_PROCESSES, TAG_WORKER_LOST
from ckpt_assets.lifecycle.ended import failure_of
from ckpt_assets.lifecycle.lost_worker import end_lost_attempt
from ckpt_assets.lifecycle.policy import decide
from ckpt_assets.lifecycle.state import State, run_state
from tests import dagster_runs
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import (
    DAGSTER,
    PYTHON,
    ROOT,
    cli,
    materializations,
    materialize_run,
    pointer_step,
    step_failure_metadata,
)
from tests.polling import pid_alive
from tests.subreaper import read_status
from trainer.api.session import CheckpointSession
from trainer.base.outcomes import Kind, Outcome
from trainer.base.process_id import ProcessId, this_machine
from trainer.checkpoints.records import CheckpointRecord
from trainer.checkpoints.repo import CheckpointRepo
from trainer.process.contract import Finished, Started
from trainer.storage import open_store

COMMANDS = str(ROOT / "tests" / "attempt_commands.py")
SUBREAPER = str(ROOT / "tests" / "subreaper.py")
log = logging.getLogger("test")


def _wait(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


# -- how an exit 0 is classified ------------------------------------------------------------

@pytest.mark.parametrize("rc,final,committed,left,outcome", [
    (0, True, True, 0, Outcome.SUCCESS),
    (0, True, True, 2, Outcome.SUCCESS),  # finished; a helper it left was stopped
    (0, False, True, 0, Outcome.UNFINISHED),  # left its loop early
    (0, False, True, 2, Outcome.UNFINISHED),  # forked and exited; the child had committed
    (0, False, False, 2, Outcome.UNFINISHED),  # forked and exited before any commit
    (0, False, False, 0, Outcome.NO_CHECKPOINT),
    (143, False, True, 1, Outcome.PREEMPTED),
    (1, False, True, 1, Outcome.USER_CODE_ERROR),
])
def test_an_exit_0_is_a_success_only_with_a_final_checkpoint(rc, final, committed, left, outcome):
    assert exit_outcome(rc, None, final=final, committed=committed, left_running=left) is outcome


def test_an_unfinished_attempt_is_never_resumed():
    assert Outcome.UNFINISHED.kind is Kind.UNFINISHED and not Kind.UNFINISHED.resumable
    assert not decide(AttemptEnd(Outcome.UNFINISHED, "r", 0, attempt=1,
                                 last_committed_step=50)).resume


def _rec(step: int, attempt: int, final: bool = False) -> CheckpointRecord:
    return CheckpointRecord(name=f"step-{step:09d}-a{attempt}", uri="file:///s", step=step,
                            attempt=attempt, sha256="0" * 64, size=1, final=final)


def test_a_checkpoint_is_final_when_marked_or_when_this_attempts_session_finished_there():
    report = AttemptReport("r", 2, started=Started(2), finished=Finished(60))
    assert report.is_final(_rec(50, 1, final=True))
    assert report.is_final(_rec(60, 2))  # no max_steps: a trigger had committed the end
    assert not report.is_final(_rec(60, 1))  # another attempt's checkpoint of that step
    assert not report.is_final(_rec(50, 2))
    assert not AttemptReport("r", 2, started=Started(2)).is_final(_rec(60, 2))
    assert not report.is_final(None)


# -- the final flag the session writes ------------------------------------------------------

def _train(store, steps: range, lost: bool = False, **kw) -> CheckpointSession:
    """A session over `steps`; `lost`: its process dies after the loop, before its end."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = CheckpointSession(run="r", experiment="e", store=str(store), install_signals=False,
                             heartbeat_seconds=60, keep_last=10, **kw)
    with contextlib.nullcontext(ckpt) if lost else ckpt:
        ckpt.restore(model=model, optimizer=opt)
        for step in steps:
            loss = model(torch.ones(1, 2)).pow(2).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ckpt.step(step, loss=loss.item())
    if lost:  # no end: what a killed process leaves (its exit hooks never run)
        ckpt._finishing = True
        ckpt._drop_exit_hooks()
        ckpt._ck.close()
        ckpt._stop_heartbeat()
    return ckpt


def _finals(store) -> dict[int, bool]:
    repo = CheckpointRepo(open_store(str(store)), "e", "r")
    return {(m := repo.read_manifest(n)).step: m.meta["final"] for n in repo.committed()}


def test_only_the_checkpoint_the_sessions_normal_end_commits_is_final(tmp_path):
    _train(tmp_path / "a", range(1, 21), max_steps=20, every_steps=5)
    assert _finals(tmp_path / "a") == {5: False, 10: False, 15: False, 20: True}
    _train(tmp_path / "c", range(1, 21), lost=True, max_steps=20, every_steps=5)
    assert _finals(tmp_path / "c") == {5: False, 10: False, 15: False}  # max_steps reached
    _train(tmp_path / "b", range(1, 13), every_steps=5)  # no max_steps: the end declares it
    assert _finals(tmp_path / "b") == {5: False, 10: False, 12: True}


def test_an_end_that_no_session_marked_final_is_committed_final_by_the_next_one(tmp_path):
    _train(tmp_path, range(1, 11), lost=True, every_steps=5)  # a trigger committed step 10
    assert _finals(tmp_path) == {5: False, 10: False}
    _train(tmp_path, range(11, 11), every_steps=5)  # resumed at the end: nothing to train
    repo = CheckpointRepo(open_store(str(tmp_path)), "e", "r")
    m = repo.read_manifest(repo.read_pointer().checkpoint)
    assert (m.step, m.attempt, m.meta["final"]) == (10, 2, True)


# -- process groups ---------------------------------------------------------------------------

LEAVES_TWO = textwrap.dedent("""
    import os, signal, sys, time
    for deaf in (False, True):
        if os.fork() == 0:
            if deaf:  # this one only goes with SIGKILL
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            time.sleep(600)
            os._exit(0)
    print("leader exits 0", flush=True)
""")


@pytest.mark.slow
def test_stopping_a_group_stops_what_its_leader_left_behind_even_what_ignores_sigterm():
    proc = subprocess.Popen([PYTHON, "-c", LEAVES_TWO], start_new_session=True,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "leader exits 0"
    assert proc.wait(30) == 0
    leader = proc.pid
    left = _wait(lambda: group_members(leader), 10, "the leader's children")
    assert len(left) == 2
    assert sorted(stop_group(leader, 1.0, log)) == sorted(left)
    assert group_members(leader) == [] and not any(pid_alive(p) for p in left)
    assert stop_group(leader, 1.0, log) == []  # nothing left: nothing to do


def _stop_signal_state() -> tuple[bool, bool, bool]:
    """What exec keeps: SIGTERM blocked in this thread; SIGTERM, SIGINT ignored."""
    return (signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []),
            signal.getsignal(signal.SIGTERM) is signal.SIG_IGN,
            signal.getsignal(signal.SIGINT) is signal.SIG_IGN)


def test_a_started_process_acts_on_stops_whatever_its_starter_blocked_or_ignored():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    for sig in before:
        signal.signal(sig, signal.SIG_IGN)
    try:
        assert _stop_signal_state() == (True, True, True)
        stoppable()  # what a trainer's process runs between fork and exec
        assert _stop_signal_state() == (False, False, False)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        for sig, handler in before.items():
            signal.signal(sig, handler)


class _Interrupted(Exception):
    """What Dagster's handler raises in a run worker that is stopped."""


_SIGNAL_IN_FORK_HOOK: list[int] = []


def _signal_inside_the_hook() -> None:
    # As a stop that reaches a run worker while it forks: handled inside an at-fork hook.
    if _SIGNAL_IN_FORK_HOOK:
        signal.raise_signal(_SIGNAL_IN_FORK_HOOK.pop())
        for _ in range(1000):  # bytecodes after it: Python runs the handler here
            pass


os.register_at_fork(after_in_parent=_signal_inside_the_hook)


def _start_with_a_signal_during_the_fork(tmp_path, held: bool) -> None:
    def interrupt(_signum, _frame):
        raise _Interrupted()

    before = signal.signal(signal.SIGINT, interrupt)
    _SIGNAL_IN_FORK_HOOK.append(signal.SIGINT)
    try:
        with stops_held() if held else contextlib.nullcontext() as stops:
            proc = start_process(["true"], dict(os.environ), str(tmp_path),
                                 str(tmp_path / "out"))
        proc.wait()
        if stops is not None:
            stops.deliver()
    finally:
        _SIGNAL_IN_FORK_HOOK.clear()
        signal.signal(signal.SIGINT, before)


@pytest.mark.slow
def test_an_interrupt_raised_inside_a_fork_hook_is_lost_so_a_process_start_holds_stops(
        tmp_path, monkeypatch):
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", ignored.append)  # "Exception ignored in ..."
    _start_with_a_signal_during_the_fork(tmp_path, held=False)  # no raise: it was lost
    assert [type(u.exc_value) for u in ignored] == [_Interrupted]


@pytest.mark.slow
def test_a_stop_that_comes_while_a_process_forks_is_delivered_once_the_process_is_in_hand(
        tmp_path):
    with pytest.raises(_Interrupted):
        _start_with_a_signal_during_the_fork(tmp_path, held=True)


class _Messages:
    def get_custom_messages(self) -> list[str]:
        return ["seen", "new"]


def test_a_stop_that_comes_while_messages_are_handled_is_raised_once_their_handling_ends():
    # Raised inside MLflow's SQLite write, it left the statement open and the database
    # locked for every write after it, the run's end included.
    handled = []

    def on_messages(msgs):
        signal.raise_signal(signal.SIGINT)
        for _ in range(1000):  # bytecodes after it: an unheld handler would raise here
            pass
        handled.append(msgs)

    def interrupt(_signum, _frame):
        raise _Interrupted()

    attempt = Attempt(argv=["true"], env={}, cwd=".", grace_s=1.0, on_messages=on_messages,
                      after_start=lambda: None)
    before = signal.signal(signal.SIGINT, interrupt)
    try:
        with pytest.raises(_Interrupted):
            hand_on_messages(_Messages(), attempt, 1, {})
    finally:
        signal.signal(signal.SIGINT, before)
    assert handled == [["new"]]


@pytest.mark.slow
def test_a_trainer_started_where_sigterm_is_ignored_and_blocked_still_ends_on_sigterm(tmp_path):
    # Both survive exec: a run worker ignores SIGTERM once Dagster mapped it to an ignored
    # SIGINT (a daemon started in the background), and the trainer's own helper threads
    # block it. The thread lives until the end: PR_SET_PDEATHSIG follows the thread that
    # started the process.
    started: list[subprocess.Popen] = []
    done = threading.Event()
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def start():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        started.append(start_process([PYTHON, "-c", "print('up', flush=True); "
                                      "import time; time.sleep(600)"],
                                     dict(os.environ), str(tmp_path), str(tmp_path / "out")))
        done.wait(120)

    helper = threading.Thread(target=start, daemon=True)
    helper.start()
    try:
        _wait(lambda: started, 60, "the process to be started")
        _wait(lambda: (tmp_path / "out").read_text().strip() == "up", 60, "its first line")
        started[0].send_signal(signal.SIGTERM)
        assert started[0].wait(60) == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
        done.set()
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize(("output", "machine", "removed"), [
    ("{tmp}/{prefix}abc.log", "here", True),
    ("{tmp}/{prefix}abc.log", "elsewhere", False),  # another machine's temp directory
    ("{tmp}/ckpt-00000000-abc.log", "here", False),  # another run's file
    ("{tmp}/{prefix}abc.txt", "here", False),
    ("/etc/{prefix}abc.log", "here", False),
    ("{tmp}/sub/{prefix}abc.log", "here", False),
])
def test_only_the_output_file_a_dead_worker_of_that_run_made_here_is_removed_for_it(
        output, machine, removed):
    import tempfile

    run_id = "1234abcd-0000"
    me = ProcessId(1, 1, this_machine() if machine == "here" else "other-boot/pid:[1]")
    path = output.format(tmp=tempfile.gettempdir(), prefix=output_prefix(run_id))
    procs = AttemptProcesses(me, me, path)
    assert (leftover_output(procs, run_id) == Path(path)) is removed


# -- a stdout whose reader died ------------------------------------------------------------------

SHIELDED = textwrap.dedent("""
    import os, sys
    from trainer.process.signals import shield_output
    r, w = os.pipe()
    os.dup2(w, 1)
    os.close(w)
    os.close(r)  # the reader is gone, as when the launching process dies
    shield_output()
    for _ in range(1000):
        print("still writing", flush=True)
    sys.stderr.write("done\\n")
""")


@pytest.mark.slow
def test_a_stdout_pipe_nobody_reads_any_more_is_pointed_at_devnull():
    proc = subprocess.run([PYTHON, "-c", SHIELDED], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "done\n"


# -- an attempt whose run worker died ---------------------------------------------------------------

def _dead_process() -> ProcessId:
    proc = subprocess.Popen(["sleep", "60"])
    ref = ProcessId.of(proc.pid)
    proc.kill()
    proc.wait()
    return ref


def _started_with(instance, worker: ProcessId):
    procs = AttemptProcesses(worker, worker, "/tmp/ckpt-output.log")
    return dagster_runs.started_run(instance, "lost", tags={TAG_PROCESSES: procs.to_tag()})


@pytest.mark.slow
def test_a_run_whose_worker_died_here_is_seen_by_a_read_and_ended_only_by_its_owner(instance):
    run = _started_with(instance, _dead_process())
    state = run_state(instance, "lost")
    assert state.state == State.TRAINING and "run worker" in state.detail
    # A read never writes: `list` and `lineage` leave the run as they found it.
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED
    end_lost_attempt(instance, run)  # the reconciler's sweep, or a re-run by hand
    run = instance.get_run_by_id(run.run_id)
    assert run.status == dg.DagsterRunStatus.FAILURE and run.tags[TAG_WORKER_LOST]
    assert failure_of(instance, run, None).outcome is Outcome.WORKER_LOST


@pytest.mark.slow
@pytest.mark.parametrize("where", ["alive", "elsewhere"])
def test_a_run_whose_worker_lives_or_ran_elsewhere_is_left_training(instance, where):
    if where == "alive":
        run = _started_with(instance, ProcessId.of())
    else:
        run = _started_with(instance, replace(_dead_process(), machine="another-boot/pid:[1]"))
    assert run_state(instance, "lost").state == State.TRAINING
    assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.STARTED


# -- through Dagster ------------------------------------------------------------------------------

def _never_finishing(steps: int = 5000, delay: float = 0.05) -> list[str]:
    return [PYTHON, COMMANDS, "print-every-step", "--steps", str(steps), "--delay", str(delay)]


@pytest.mark.slow
def test_a_command_that_forks_and_exits_0_fails_unfinished_and_leaves_no_process(
        instance, tmp_path, mlflow_uri):
    from ckpt_assets.definitions import make_resources

    store = tmp_path / "store"
    pids_file = tmp_path / "pids.json"
    pointer = store / "default" / "forks" / "checkpoints" / "latest.json"
    cfg = {"command": [PYTHON, COMMANDS, "fork-and-exit", "--pointer", str(pointer),
                       "--pids", str(pids_file), "--", *_never_finishing()],
           "max_steps": 5000}
    res = materialize_run(instance, "forks", make_resources(str(store)), training=cfg)
    assert not res.success
    desc, md = step_failure_metadata(res)
    ended = AttemptEnd.from_metadata(md)
    assert (ended.outcome, ended.exit_code) == (Outcome.UNFINISHED, 0), desc
    assert "were stopped" in ended.message and "final checkpoint" in desc
    assert not decide(ended).resume
    assert materializations(res, "model_checkpoint") == []
    assert materializations(res, "final_model") == []
    # Nothing of the attempt is left: not the launcher, its child, nor the command.
    pids = json.loads(pids_file.read_text())
    assert not [p for p in pids.values() if pid_alive(p)], pids
    assert group_members(pids["launcher"]) == []
    # The command was stopped, not killed: it committed on the group's SIGTERM.
    repo = CheckpointRepo(open_store(str(store)), "default", "forks")
    m = repo.read_manifest(repo.read_pointer().checkpoint)
    assert m.meta["reason"] == "preempted" and m.meta["final"] is False
    assert ended.last_committed_step == m.step

@pytest.mark.slow
def test_an_attempt_interrupted_during_mlflows_start_up_ends_only_once_the_start_up_is_done():
    from ckpt_assets.attempt.process import Attempt, run_under_pipes

    opened, seen = threading.Event(), {}

    def slow_start_up():  # the interrupt lands while MLflow is still opening
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
        opened.set()

    @dg.asset
    def attempt(context):
        outcome = run_under_pipes(context, Attempt(
            [PYTHON, "-c", "import time; time.sleep(60)"], dict(os.environ), str(ROOT),
            grace_s=10, on_messages=lambda msgs: None, after_start=slow_start_up))
        seen["opened"], seen["rc"] = opened.is_set(), outcome.returncode
        raise outcome.interrupted

    result = dg.materialize([attempt], raise_on_error=False)
    assert not result.success
    assert seen == {"opened": True, "rc": -signal.SIGTERM}  # stopped, then waited for



@pytest.mark.slow
def test_a_printing_command_whose_dagster_process_is_sigkilled_commits_and_exits_143(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    from ckpt_assets.cli.main import main as cli_main

    config = tmp_path / "train.json"
    config.write_text(json.dumps({"command": _never_finishing(), "max_steps": 5000}))
    assert cli_main(["register", "printer", "--config", str(config)]) == 0
    status = tmp_path / "exits.jsonl"
    reaper = subprocess.Popen(
        [PYTHON, SUBREAPER, str(status), "--", DAGSTER, "asset", "materialize", "--select",
         "training_dataset,model_checkpoint,final_model", "--partition", "printer", "-m",
         "ckpt_assets.definitions"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=open(tmp_path / "materialize.log", "wb"), stderr=subprocess.STDOUT)
    store = Path(store_uri)
    try:
        _wait(lambda: (pointer_step(store, "default", "printer") or 0) >= 10, 180,
              "a committed checkpoint")
        instance = dg.DagsterInstance.get()
        (run,) = instance.get_runs()
        procs = AttemptProcesses.of_run(run)
        dagster_pid, _ = read_status(status)
        assert procs.worker.pid == dagster_pid
        os.kill(dagster_pid, signal.SIGKILL)  # no handler runs in the orchestrator
        reaper.wait(120)  # until every process of the tree has exited
    finally:
        if reaper.poll() is None:
            reaper.kill()
    _, exits = read_status(status)
    assert exits[dagster_pid] == -signal.SIGKILL
    assert exits[procs.group.pid] == 143, (exits, Path(procs.output).read_text()[-3000:])
    # The step in progress was committed: the last step the script printed.
    printed = [int(line.split()[1]) for line in Path(procs.output).read_text().splitlines()
               if line.startswith("step ")]
    repo = CheckpointRepo(open_store(store_uri), "default", "printer")
    m = repo.read_manifest(repo.read_pointer().checkpoint)
    assert m.meta["reason"] == "preempted" and m.step == printed[-1]
    os.unlink(procs.output)
    # `list` reads, never writes: it says the worker is gone and what resumes the run.
    listed = cli("list", "--json")
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert row["state"] == State.TRAINING.value and "run worker" in row["detail"], row
    assert "python -m ckpt_assets run printer" in row["detail"], row
    assert row["latest_step"] == m.step
    (run,) = dg.DagsterInstance.get().get_runs()
    assert run.status == dg.DagsterRunStatus.STARTED


PIPED_PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    print(child.pid, flush=True)
    for line in child.stdout:  # read until killed: the pipe's only reader
        pass
""")


@pytest.mark.slow
def test_a_printing_script_whose_stdout_pipe_died_with_its_parent_commits_and_exits_143(
        tmp_path):
    """Without the orchestrator's output file: the session itself keeps the stop path alive."""
    from trainer.process.contract import LaunchEnv

    told = LaunchEnv("piped", "default", str(tmp_path / "store"), attempt=1)
    status = tmp_path / "exits.jsonl"
    env = {**LaunchEnv.scrubbed(os.environ), "PYTHONPATH": str(ROOT), **told.to_env()}
    reaper = subprocess.Popen(
        [PYTHON, SUBREAPER, str(status), "--", PYTHON, "-c", PIPED_PARENT,
         *_never_finishing(delay=0.02)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        script = int(reaper.stdout.readline())
        _wait(lambda: (pointer_step(tmp_path / "store", "default", "piped") or 0) >= 10, 120,
              "a committed checkpoint")
        parent, _ = read_status(status)
        os.kill(parent, signal.SIGKILL)
        reaper.wait(120)
    finally:
        if reaper.poll() is None:
            reaper.kill()
    _, exits = read_status(status)
    assert exits[script] == 143, exits
    repo = CheckpointRepo(open_store(str(tmp_path / "store")), "default", "piped")
    assert repo.read_manifest(repo.read_pointer().checkpoint).meta["reason"] == "preempted"
