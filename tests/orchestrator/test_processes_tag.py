"""The run tag `ckpt/processes` (`ckpt_assets.base.attempt_processes`): an attempt's run
worker and process group, each one `ProcessId`, read back as written; a tag written by an
older version (one machine for both, `{"pid", "start"}` each) still reads, so the runs it
recorded stay stoppable; anything else reads as no record."""

from __future__ import annotations

import dataclasses
import json
import subprocess

import dagster as dg
import pytest

from ckpt_assets.base.attempt_processes import AttemptProcesses
from ckpt_assets.base.tags import TAG_PROCESSES, TAG_WORKER_LOST
from ckpt_assets.lifecycle.lost_worker import end_lost_attempt
from tests import dagster_runs
from tests.polling import pid_alive, wait_for
from trainer.base.process_id import ProcessId, this_machine


@pytest.fixture
def instance():
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst

def _old_tag(machine: str | None, worker: ProcessId, group: ProcessId, output: str) -> str:
    """The tag as the version before `ProcessId` wrote it (`asdict` of its record)."""
    return json.dumps({"machine": machine,
                       "worker": {"pid": worker.pid, "start": worker.start_ticks},
                       "group": {"pid": group.pid, "start": group.start_ticks},
                       "output": output, "ended": False}, separators=(",", ":"))


def test_the_tag_reads_back_as_written():
    me = ProcessId.of()
    procs = AttemptProcesses(me, dataclasses.replace(me, pid=me.pid + 1), "/tmp/out.log", True)
    assert AttemptProcesses.of_tag(procs.to_tag()) == procs
    assert set(json.loads(procs.to_tag())["worker"]) == {"pid", "start_ticks", "machine", "pgid"}


def test_a_tag_of_the_older_format_reads_as_the_same_processes():
    me = ProcessId.of()
    old = AttemptProcesses.of_tag(_old_tag(this_machine(), me, me, "/tmp/out.log"))
    mine = ProcessId(me.pid, me.start_ticks, this_machine())
    assert old == AttemptProcesses(mine, mine, "/tmp/out.log")
    assert old.worker.running() and not old.worker_gone()
    reused = _old_tag(this_machine(), dataclasses.replace(me, start_ticks=me.start_ticks + 1),
                      me, "/tmp/out.log")
    assert AttemptProcesses.of_tag(reused).worker_gone()
    elsewhere = AttemptProcesses.of_tag(_old_tag("another-boot/pid:[1]", me, me, "/tmp/o.log"))
    assert not elsewhere.worker_gone() and elsewhere.left() == []
    # Where /proc could not say, the older version wrote start 0 and no machine.
    unknown = AttemptProcesses.of_tag(_old_tag(None, ProcessId(me.pid, 0), me, "/tmp/o.log"))
    assert not unknown.worker.here() and not unknown.worker_gone()


@pytest.mark.parametrize("tag", [
    "", "not json", "[]", '"machine"', "{}", '{"worker": {"pid": 1}}',
    '{"worker": {"pid": "x"}, "group": {"pid": 1}, "output": "o"}',
    '{"worker": {"pid": 1, "machine": 5}, "group": {"pid": 1}, "output": "o"}',
    '{"machine": "m", "worker": {"pid": 1}, "group": {"pid": 1, "start": 2}, "output": "o"}',
    '{"machine": 5, "worker": {"pid": 1, "start": 2}, "group": {"pid": 1, "start": 2}, '
    '"output": "o"}',
])
def test_a_tag_that_names_no_processes_reads_as_none(tag):
    assert AttemptProcesses.of_tag(tag) is None


@pytest.mark.slow
def test_a_run_recorded_by_the_older_version_whose_worker_died_is_ended_and_its_group_stopped(
        instance):
    worker = subprocess.Popen(["sleep", "60"])
    dead = ProcessId.of(worker.pid)
    worker.kill()
    worker.wait()
    trainer = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        tag = _old_tag(this_machine(), dead, ProcessId.of(trainer.pid), "/tmp/ckpt-old.log")
        run = dagster_runs.started_run(instance, "old", tags={TAG_PROCESSES: tag})
        assert AttemptProcesses.of_run(run).left() == [trainer.pid]
        end_lost_attempt(instance, run)
        run = instance.get_run_by_id(run.run_id)
        assert run.status == dg.DagsterRunStatus.FAILURE and run.tags[TAG_WORKER_LOST]
        assert trainer.wait(30) < 0  # stopped by its group's SIGTERM
        wait_for(lambda: not pid_alive(trainer.pid), 30, what="the old group to be gone")
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
