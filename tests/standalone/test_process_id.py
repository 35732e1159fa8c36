"""One process ever (`trainer.base.process_id.ProcessId`): the trainer's heartbeat and the
orchestrator's record of an attempt name a process by its machine, pid and start time, so a
pid the kernel handed on, or one read on another machine, is never taken for it."""

from __future__ import annotations

import dataclasses
import os

import pytest

from trainer.base.process_id import ProcessId, boot_id, this_machine
from trainer.checkpoints.records import Beat

NO_SUCH_PID = 2**22 + 1  # above Linux's pid_max


def test_this_process_is_here_and_running_in_its_own_process_group():
    me = ProcessId.of()
    assert (me.pid, me.machine, me.pgid) == (os.getpid(), this_machine(), os.getpgrp())
    assert me.here() and me.running() and not me.gone()
    assert me.group_now() == os.getpgrp()


def test_a_process_with_its_pid_started_at_another_time_is_not_it_and_known_gone():
    me = ProcessId.of()
    reused = dataclasses.replace(me, start_ticks=me.start_ticks + 1)
    assert not reused.running() and reused.gone()
    exited = ProcessId(NO_SUCH_PID, me.start_ticks, this_machine())
    assert not exited.running() and exited.gone() and exited.group_now() is None


@pytest.mark.parametrize("where", [
    pytest.param({"machine": "another-boot/pid:[4026531836]"}, id="another machine"),
    pytest.param({"machine": None}, id="machine unknown"),
    pytest.param({"start_ticks": None}, id="start time unknown"),
])
def test_a_process_not_known_to_be_here_is_neither_running_nor_gone(where):
    # Nobody here can tell: the orchestrator neither signals it nor judges its run lost.
    other = dataclasses.replace(ProcessId.of(), **where)
    assert not other.here() and not other.running() and not other.gone()


def test_a_process_that_proc_cannot_show_is_known_by_its_pid_only():
    assert ProcessId.of(NO_SUCH_PID) == ProcessId(NO_SUCH_PID)


def test_an_identity_reads_back_as_written_and_a_malformed_one_is_refused():
    me = ProcessId.of()
    assert ProcessId.from_dict(me.to_dict()) == me
    assert ProcessId.from_dict({"pid": 7, "more": "ignored"}) == ProcessId(7)
    for bad in ({}, {"pid": "x"}, {"pid": 7, "start_ticks": "12"}, {"pid": 7, "machine": 3}):
        with pytest.raises((KeyError, TypeError, ValueError)):
            ProcessId.from_dict(bad)


def test_a_heartbeat_names_its_writer_and_an_older_trainers_beat_one_never_judged_here():
    me = ProcessId.of()
    beat = Beat.from_dict({"time": 1.0, "host": "h", **me.to_dict()})
    assert beat.process == me and beat.process.running()
    # Written before beats named a machine: host and boot id only.
    old = Beat.from_dict({"time": 1.0, "pid": me.pid, "host": "h", "boot_id": boot_id(),
                          "pgid": me.pgid, "start_ticks": me.start_ticks})
    assert not old.process.here() and not old.process.gone()
