"""Tasks written the way a user might (including the mistakes), for the tests."""

from __future__ import annotations

import torch

from trainer.api.task import Task, TaskArgs
from trainer.tasks import regression, toy


def wrong_optimizer(t: TaskArgs) -> Task:
    task = regression.build(t)
    task.optimizer = "sgd"  # a name, not an optimizer
    return task


def own_optimizer(t: TaskArgs) -> Task:
    """SGD with momentum and a StepLR, built by the task; AMP and accumulation from config."""
    task = regression.build(t)
    task.optimizer = lambda model: torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    task.scheduler = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=15, gamma=0.5)
    return task


def directory_dataset(t: TaskArgs) -> Task:
    """A run whose `dataset` is a directory of files the trainer versions (and refuses when
    it holds what cannot be read safely); the model trains on the toy task's generated data,
    so its result matches the toy task's on the same seed."""
    return toy.build(TaskArgs(t.args, t.seed))


def strict_eval(t: TaskArgs) -> Task:
    """A task whose evaluation insists on eval mode without gradients."""
    task = toy.build(t)
    inner = task.eval_fn

    def eval_fn(model):
        assert not model.training, "evaluated in training mode"
        assert not torch.is_grad_enabled(), "evaluated with gradients on"
        return inner(model)

    task.eval_fn = eval_fn
    return task


def lbfgs(t: TaskArgs) -> Task:
    """LBFGS: its step needs a closure, and its state keeps a history of past steps."""
    task = regression.build(t)
    task.optimizer = lambda model: torch.optim.LBFGS(model.parameters(), lr=0.2, max_iter=4,
                                                     history_size=8)
    return task


def crash_once(t: TaskArgs) -> Task:
    """The toy task, SIGKILLed once before step `crash_once_at` (the marker file
    `crash_marker` says it happened, and when), as an OOM kill or a lost node kills a trainer.
    `crash_after_standby`: only once the next attempt's standby is there; `signal_standby`
    (a signal's name): which is sent that signal first (its pid goes in the marker)."""
    import os
    import signal
    from pathlib import Path

    mine = ("crash_once_at", "crash_marker", "crash_after_standby", "signal_standby")
    task = toy.build(TaskArgs({k: v for k, v in t.args.items() if k not in mine}, t.seed))
    inner, marker = task.before_step, Path(t.args["crash_marker"])

    def before_step(step: int) -> None:
        if step == t.args["crash_once_at"] and not marker.exists():
            standby = None
            if t.args.get("crash_after_standby"):
                standby = _wait_for_a_sibling_standby()
                if t.args.get("signal_standby") and standby is not None:
                    _signal_standby(standby, getattr(signal, t.args["signal_standby"]))
            marker.write_text(f"{step} {standby or ''}".strip())
            os.kill(os.getpid(), signal.SIGKILL)
        inner(step)

    task.before_step = before_step
    return task


def _wait_for_a_sibling_standby(timeout_s: float = 120) -> int | None:
    """Until the orchestrator (this process's parent) has started the standby for the next
    attempt (its pid): on a busy machine its start can come after a short attempt's death,
    and then the relaunch is cold (correct, but not what a test of the warm relaunch is
    about)."""
    import os
    import time
    from pathlib import Path

    from trainer.process.standby import MODULE

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
                cmdline = (stat.parent / "cmdline").read_bytes()
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            if (ppid == os.getppid() and int(stat.parent.name) != os.getpid()
                    and MODULE.encode() in cmdline):
                return int(stat.parent.name)
        time.sleep(0.05)
    return None


def _signal_standby(pid: int, sig: int, timeout_s: float = 30) -> None:
    """Send `sig` to the standby `pid`, and wait until it took effect: stopped (state T) for
    SIGSTOP, dead (a zombie its parent has not reaped, or gone) for any other."""
    import os
    import signal
    import time

    os.kill(pid, sig)
    wanted = ("T",) if sig == signal.SIGSTOP else ("Z", "X", None)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = None
        if state in wanted:
            return
        time.sleep(0.01)
