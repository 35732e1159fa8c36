"""Liveness is not progress, under a real dagster-daemon: a healthy step far longer than the
heartbeat timeout is never taken for a dead trainer, and a trainer that is declared dead is
stopped before its resume starts.

The daemon runs with CKPT_HEARTBEAT_TIMEOUT_S shortened (and the grace for the run worker's
own work before and after its trainer generous: start-up on a busy machine says nothing
about how often a live trainer beats), and the shipped defaults otherwise (the warm standby
on); a sampler reads, every 0.2 s, which processes of each attempt are alive and the run's
heartbeat. It finds an attempt's processes as the orchestrator records them, by the run's
`ckpt/processes` tag (the leader of the attempt's process group, by pid and start time),
not by their environment: a trainer that began as a warm standby shows in /proc the
environment it started with, without the attempt's names it took on at its handoff.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest

from ckpt_assets.attempt.process import PROCESS_STARTED, WARM_STARTED
from ckpt_assets.base.attempt_processes import AttemptProcesses
from ckpt_assets.base.tags import TAG_FAILURE_KIND, TAG_HEARTBEAT_LOST, TAG_STALLED
from ckpt_assets.base.view import RunView
from ckpt_assets.lifecycle.settings import Setting
from tests.daemon_harness import Daemon, baseline_config, kill, training_config
from tests.polling import pid_alive
from tests.trainer_proc import assert_bitwise_equal, final_state, training_state
from trainer.base.process_id import ProcessId
from trainer.checkpoints.records import Beat
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import open_store

pytestmark = pytest.mark.slow

# A step three times as long must pass for alive.
TIMEOUT_S = 10


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    work = tmp_path_factory.mktemp("liveness")
    d = Daemon.start(work, str(work / "store"), {
        Setting.HEARTBEAT_TIMEOUT_S.value: str(TIMEOUT_S),
        Setting.WORKER_GRACE_S.value: "180"})
    yield d
    d.stop()


class Sampler(threading.Thread):
    """Samples the live processes of the run's attempts and its heartbeat until stopped."""

    def __init__(self, daemon: Daemon, run: str):
        super().__init__(daemon=True)
        self.daemon_, self.run_ = daemon, run
        self.samples: list[dict[int, int]] = []  # {pid: attempt}, oldest first
        self.beats: list[Beat] = []
        # Every attempt's process group seen on the run's tag, and the attempt it was (a
        # relaunch in the run records its own over it, and the run's attempt moves on).
        self.groups: dict[ProcessId, tuple[AttemptProcesses, int]] = {}
        self._halt = threading.Event()

    def attempts_alive(self) -> dict[int, int]:
        """{pid: attempt} of the live processes of the run's attempts."""
        for run in self.daemon_.runs(self.run_):
            procs = AttemptProcesses.of_run(run)
            if procs is not None and procs.group not in self.groups:
                self.groups[procs.group] = (procs, RunView.of(run).attempt)
        return {pid: attempt for procs, attempt in self.groups.values() for pid in procs.left()}

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append(self.attempts_alive())
            beat = Beat.from_dict(self.daemon_.heartbeat(self.run_))
            if beat is not None and (not self.beats or beat != self.beats[-1]):
                self.beats.append(beat)
            time.sleep(0.2)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)

    def most_attempts_at_once(self) -> int:
        return max((len(set(s.values())) for s in self.samples), default=0)

    def seen(self, pred) -> list[int]:
        """Indexes of the samples in which some process matched pred(pid, attempt)."""
        return [i for i, s in enumerate(self.samples) if any(pred(p, a) for p, a in s.items())]


def _beat(daemon: Daemon, run: str) -> Beat | None:
    return Beat.from_dict(daemon.heartbeat(run))


def _warm_starts(daemon: Daemon, run_id: str) -> list[bool]:
    """For each attempt's start in Dagster run `run_id`: did its standby become it?"""
    return [WARM_STARTED in r.user_message for r in daemon.instance.all_logs(run_id)
            if r.user_message.startswith(PROCESS_STARTED)]


def test_a_healthy_step_three_times_the_heartbeat_timeout_is_never_declared_dead(
        daemon, tmp_path):
    name, release = "long-step", tmp_path / "release"
    # Its first step (as a compiled one would) lasts until the test releases it.
    cfg = training_config(name, max_steps=20, task="tests.liveness_tasks:build",
                          checkpoint={"every_steps": 5, "heartbeat_seconds": 1},
                          task_args={"release_file": str(release)})
    sampler = Sampler(daemon, name)
    sampler.start()
    daemon.launch(name, cfg, tmp_path)
    claimed = daemon.wait_until(lambda: (b := _beat(daemon, name)) and b.attempt and b,
                                "the trainer to claim the run")
    assert claimed.step == 0
    # Once the step is older than the timeout, every sweep of the reconciler sees a step
    # that a per-step heartbeat would have let go stale; let it sweep twice, and the step
    # last three times the timeout, before it ends.
    daemon.wait_until(lambda: time.time() - claimed.step_time > TIMEOUT_S, "the timeout")
    daemon.wait_for_ticks({"reconcile_training_runs": 2}, timeout=300)
    daemon.wait_until(lambda: time.time() - claimed.step_time > 3 * TIMEOUT_S, "3x the timeout")
    release.touch()
    final = daemon.wait_done(name)
    sampler.stop()
    (only,) = daemon.runs(name)
    assert only.run_id == final.run_id
    assert TAG_HEARTBEAT_LOST not in final.tags and TAG_STALLED not in final.tags
    first_step = next(b for b in sampler.beats if b.step and b.step >= 1)
    assert first_step.step_time - claimed.step_time > 3 * TIMEOUT_S
    assert {b.attempt for b in sampler.beats if b.attempt} == {1}
    assert sampler.most_attempts_at_once() == 1
    assert _warm_starts(daemon, only.run_id) == [True]  # the sampler saw a warm-started one
    assert daemon.max_active[name] == 1


def test_a_frozen_trainer_declared_dead_is_gone_before_its_resume_while_a_run_with_a_longer_timeout_of_its_own_outlives_the_silence(
        daemon, tmp_path, uninterrupted):
    """One daemon, whose deployment timeout is TIMEOUT_S: "patient" registered a timeout of
    its own. Each trainer is frozen (SIGSTOP: alive, its heartbeat thread silent with it) at
    step 15. "hasty" is declared dead, and its frozen trainer is gone before its resume
    starts; "patient" outlives the same silence and trains on once woken."""
    own = {"heartbeat_timeout_seconds": 600.0}
    runs = {"hasty": training_config("hasty", max_steps=60, checkpoint={"heartbeat_seconds": 1}),
            "patient": training_config("patient", max_steps=60,
                                       checkpoint={"heartbeat_seconds": 1}, resume=own)}
    sampler = Sampler(daemon, "hasty")
    sampler.start()
    repo = CheckpointRepo(open_store(daemon.store), "default", "hasty")
    pids, silent_since = {}, {}
    for name, cfg in runs.items():
        daemon.launch(name, cfg, tmp_path)
        pids[name] = int(daemon.wait_for_step(name, 15, attempt=1)["pid"])
        kill(pids[name], signal.SIGSTOP)
        silent_since[name] = time.time()
        if name == "hasty":
            before = set(repo.read_pointer().timeline)
    daemon.wait_until(lambda: TAG_HEARTBEAT_LOST in daemon.runs("hasty")[0].tags,
                      "the hasty run to be declared dead", timeout=300)
    # Past three deployment timeouts of silence, and two more sweeps: the patient run is
    # still its one STARTED run, never judged.
    daemon.wait_until(lambda: time.time() - silent_since["patient"] > 3 * TIMEOUT_S,
                      "3x the timeout")
    daemon.wait_for_ticks({"reconcile_training_runs": 2}, timeout=300)
    (patient,) = daemon.runs("patient")
    assert patient.status.value == "STARTED" and TAG_HEARTBEAT_LOST not in patient.tags
    kill(pids["patient"], signal.SIGCONT)
    final = daemon.wait_done("patient")
    assert final.run_id == patient.run_id and final.status.value == "SUCCESS"
    _declared_dead_and_gone(daemon, sampler, pids["hasty"], before, uninterrupted)


def _declared_dead_and_gone(daemon: Daemon, sampler: Sampler, pid: int, before: set,
                            uninterrupted) -> None:
    """The hasty run, resumed by the deployment's timeout: its frozen trainer `pid` was
    stopped before its resume started, wrote nothing after it froze (`before`: the run's
    timeline then), and every view names the attempt's end as the reconciler's verdict."""
    final = daemon.wait_done("hasty")
    sampler.stop()
    failed, resume = daemon.runs("hasty")
    assert resume.run_id == final.run_id
    said = daemon.failures_of("hasty")  # what the reconciler did, in the failed run's own log
    assert failed.tags[TAG_HEARTBEAT_LOST].startswith("trainer heartbeat lost")
    assert "fenced: attempts up to 1" in said, said
    assert f"trainer pid {pid} " in said and ("stopped by SIGTERM" in said or "killed" in said)
    assert failed.tags[TAG_FAILURE_KIND] == "killed"
    # Its end is the reconciler's verdict wherever it is read, not the signal's kill that
    # the verdict caused (`killed_by_signal`).
    names = daemon.outcome_names("hasty", failed.run_id, attempt=1)
    assert set(names.values()) == {"heartbeat_lost"}, names
    # The frozen trainer was last seen before the resume's trainer was first seen: the two
    # never ran at once, and it is gone now.
    old, new = sampler.seen(lambda p, a: p == pid), sampler.seen(lambda p, a: a == 2)
    assert old and new and max(old) < min(new), (old[-3:], new[:3])
    assert sampler.most_attempts_at_once() == 1
    assert _warm_starts(daemon, failed.run_id) == [True]
    assert not pid_alive(pid)
    # Nothing it wrote after it froze entered the run's history (it was fenced).
    after = CheckpointRepo(open_store(daemon.store), "default", "hasty").read_pointer().timeline
    assert {n for n in after if n.endswith("-a1")} <= before
    assert daemon.max_active["hasty"] == 1
    assert_bitwise_equal(uninterrupted(baseline_config()),
                         training_state(final_state(Path(daemon.store), run="hasty")))
