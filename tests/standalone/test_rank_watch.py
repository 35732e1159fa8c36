"""Every rank watched: a rank that stops beating ends its attempt as rank_lost.

Fast: the launcher's watch kills a child rank whose beat is older than the heartbeat
timeout, and nothing else (a fresh beat, a process that is not its child); a rank's beat
file holds its pid and is gone once its session ends.

Slow (real processes, real gloo, a real SIGSTOP): two ranks under `python -m trainer.ranks`,
rank 1 frozen; the launcher exits 7 (`rank_lost`) within twice the heartbeat timeout,
no rank is left running, and the next attempt resumes from the last committed checkpoint.
Two nodes on one machine (two launchers, one c10d endpoint on loopback): one node's
launcher SIGKILLed fails the attempt as one (both launchers exit non-zero, no rank left),
and a rerun of both resumes from the last checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.polling import wait_for
from tests.ports import free_port
from tests.rank_runs import (
    env,
    gone,
    pointer_step,
    rank_pids,
    start_torchrun,
    trainer_argv,
    wait_for_step,
)
from tests.trainer_proc import write_config
from trainer.base.outcomes import Outcome
from trainer.checkpoints.repo import CheckpointRepo
from trainer.ranks import rank_watch
from trainer.ranks.rank_watch import RankBeat, RankWatch, beat_file
from trainer.storage import open_store

LOST = Outcome.RANK_LOST.exit_code
TIMEOUT_S = 10.0
EXPERIMENT, RUN = "default", "frozen"


def _beat(directory: Path, rank: int, pid: int, age_s: float) -> None:
    path = beat_file(directory, rank)
    path.write_text(str(pid))
    then = time.time() - age_s
    os.utime(path, (then, then))


def test_the_watch_kills_only_its_own_rank_whose_beat_is_older_than_the_timeout(
        tmp_path, monkeypatch):
    children, killed = {101, 102}, []
    monkeypatch.setattr(rank_watch, "child_exists", lambda pid, parent: pid in children)
    monkeypatch.setattr(rank_watch.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    _beat(tmp_path, 0, 101, age_s=1)  # beating
    _beat(tmp_path, 1, 102, age_s=TIMEOUT_S + 5)  # silent
    _beat(tmp_path, 2, 103, age_s=TIMEOUT_S + 5)  # silent, but not this launcher's child
    watch = RankWatch(tmp_path, TIMEOUT_S)
    watch.check(time.time())
    watch.check(time.time())  # killed once
    assert watch.lost == {1: 102}
    assert killed == [(102, signal.SIGKILL)]


def test_a_child_is_told_from_a_process_that_only_reuses_a_pid():
    assert rank_watch.child_exists(os.getpid(), os.getppid())
    assert not rank_watch.child_exists(os.getpid(), os.getpid())


def test_a_rank_that_never_beat_or_whose_session_ended_is_not_judged(tmp_path):
    beat = RankBeat(3, str(tmp_path))
    beat.start()
    assert beat_file(tmp_path, 3).read_text() == str(os.getpid())
    beat.stop()
    assert not beat_file(tmp_path, 3).exists()
    watch = RankWatch(tmp_path, TIMEOUT_S)
    watch.check(time.time() + 10 * TIMEOUT_S)
    assert watch.lost == {}


def test_a_process_outside_the_launcher_does_not_beat(tmp_path, monkeypatch):
    monkeypatch.delenv("CKPT_RANK_BEATS", raising=False)
    beat = RankBeat(0)
    beat.start()
    beat.stop()
    assert beat.path is None


@pytest.mark.slow
def test_a_frozen_rank_ends_the_attempt_as_rank_lost_and_the_last_checkpoint_resumes(tmp_path):
    config = write_config(tmp_path / "two.json", run=RUN, max_steps=40, eval_every=0,
                          checkpoint={"every_steps": 4, "keep_last": 2},
                          distributed={"nproc_per_node": 2})
    store, log = tmp_path / "store", tmp_path / "ranks.log"
    argv = trainer_argv(config, str(store))
    launcher = start_torchrun(argv, 2, env(0.05), log, "--heartbeat-timeout-s", str(TIMEOUT_S))
    ranks = rank_pids(launcher, 2)
    try:
        wait_for_step(store, EXPERIMENT, RUN, 8, launcher)
        os.kill(ranks[1], signal.SIGSTOP)
        rc = launcher.wait(timeout=2 * TIMEOUT_S)  # the bound
    except BaseException:
        _end(launcher, ranks.values())
        raise
    text = log.read_text()
    assert rc == LOST, text[-3000:]
    assert Outcome.of_exit(rc) is Outcome.RANK_LOST
    assert f"rank 1 (pid {ranks[1]}) sent no liveness beat" in text
    gone(list(ranks.values()), timeout=60)  # the attempt's processes are all gone

    committed = pointer_step(store, EXPERIMENT, RUN)
    manifest, skipped = CheckpointRepo(open_store(str(store)), EXPERIMENT, RUN).find_latest_valid()
    assert manifest is not None and manifest.step == committed and not skipped
    again = start_torchrun(argv, 2, env(0), log)
    try:
        assert again.wait(timeout=300) == 0, log.read_text()[-3000:]
    except BaseException:
        _end(again, [])
        raise
    assert f"at step {committed} " in log.read_text()[len(text):]
    assert pointer_step(store, EXPERIMENT, RUN) == 40


def _end(launcher: subprocess.Popen, ranks) -> None:
    """A failed test leaves nothing running (a stopped rank included)."""
    for pid in ranks:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    if launcher.poll() is None:
        launcher.kill()
        launcher.wait()



def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _two_nodes(argv: list[str], log: Path, step_delay: float) -> list[subprocess.Popen]:
    """Two launchers of one rank each, meeting at one c10d endpoint on loopback: what two
    machines do. Node 0 hosts the rendezvous store; node 1 joins once it listens."""
    port = free_port()
    meet = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two"]
    node0 = start_torchrun(argv, 1, env(step_delay), log, *meet)
    wait_for(lambda: node0.poll() is not None or _listening(port), 120,
             what="node 0's rendezvous store")
    return [node0, start_torchrun(argv, 1, env(step_delay), log, *meet)]


@pytest.mark.slow
def test_two_nodes_fail_as_one_when_a_launcher_is_killed_and_a_rerun_resumes(tmp_path):
    config = write_config(tmp_path / "nodes.json", run=RUN, max_steps=40, eval_every=0,
                          checkpoint={"every_steps": 4, "keep_last": 2})
    store, log = tmp_path / "store", tmp_path / "nodes.log"
    argv = trainer_argv(config, str(store))
    nodes = _two_nodes(argv, log, 0.05)
    pids = []
    try:
        pids = [*rank_pids(nodes[0], 1).values(), *rank_pids(nodes[1], 1).values()]
        wait_for_step(store, EXPERIMENT, RUN, 8, nodes[0])
        nodes[1].send_signal(signal.SIGKILL)
        codes = [n.wait(timeout=300) for n in nodes]
    except BaseException:
        for n in nodes:
            _end(n, pids)
        raise
    text = log.read_text()
    print(f"two nodes, node 1's launcher SIGKILLed: launchers exited {codes}")
    assert all(c != 0 for c in codes), (codes, text[-3000:])
    gone(pids, timeout=120)  # node 1's orphaned rank too: nothing of the attempt is left
    committed = pointer_step(store, EXPERIMENT, RUN)
    again = _two_nodes(argv, log, 0)
    try:
        assert [n.wait(timeout=300) for n in again] == [0, 0], log.read_text()[-3000:]
    except BaseException:
        for n in again:
            _end(n, [])
        raise
    assert f"at step {committed} " in log.read_text()[len(text):]
    assert pointer_step(store, EXPERIMENT, RUN) == 40
