"""The toy task with one healthy step as long as a test wants: a compiled first step, a large
gradient accumulation, a slow first read of S3 data. The training itself is the toy task's,
bit for bit (a resume still ends identical to an uninterrupted run).

task_args, besides the toy task's:
  long_step_at   the step that is long (default: the first step this process trains)
  long_step_s    how long it lasts, in seconds
  release_file   or: it lasts until this file exists (at most MAX_HOLD_S)
  slow_start_from_attempt
                 instead: from this attempt on, the task's build (before the trainer's first
                 heartbeat) is what lasts, as a start-up on a loaded machine does
"""

from __future__ import annotations

import os
import time

from trainer.api.task import Task, TaskArgs
from trainer.process.contract import Env
from trainer.tasks import toy

MAX_HOLD_S = 600.0


def build(t: TaskArgs) -> Task:
    args = dict(t.args)
    at = args.pop("long_step_at", None)
    seconds = float(args.pop("long_step_s", 0.0))
    release = args.pop("release_file", None)
    slow_from = args.pop("slow_start_from_attempt", None)
    task = toy.build(TaskArgs(args, t.seed, t.dataset))
    if slow_from is not None:
        if int(os.environ.get(Env.ATTEMPT.value, "1")) >= slow_from:
            _hold(seconds, release)
        return task
    inner, first = task.before_step, []

    def before_step(step: int) -> None:
        inner(step)
        if step == at or (at is None and not first):
            _hold(seconds, release)
        first.append(step)

    task.before_step = before_step
    return task


def _hold(seconds: float, release: str | None) -> None:
    if release is None:
        time.sleep(seconds)
        return
    deadline = time.monotonic() + MAX_HOLD_S
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.1)
