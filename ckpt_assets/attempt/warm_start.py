"""A warm trainer: the next attempt's interpreter, started while this attempt trains.

A fresh trainer spends about 2 s, and 3 s while its run worker is busy beside it,
importing torch, Dynamo and the trainer before its first step. `WarmTrainer` keeps at most one
standby process (`trainer.process.standby`) per Dagster run, with the attempt's interpreter, working
directory and environment less the per-attempt names:
- for the run's first attempt, started by the run's first step (`training_dataset`), so that
  it imports torch while the run worker loads the dataset record and prepares the attempt;
- for a relaunch in the same run (`ckpt_assets.attempt.in_run`), started once the attempt it stands
  beside has sent its first message (so it never competes with that attempt's own start-up).
When the attempt is launched, the standby is handed it and becomes it; a new standby is
started beside the new attempt in turn.

What it costs: one idle interpreter with torch and Dynamo imported (about 370 MB resident,
no CPU once imported) for as long as the step trains, and nothing when it is not used. It is
stopped when the step ends, and it ends by itself when the step's process dies (its stdin
closes; PR_SET_PDEATHSIG as a trainer has).

Where it is not used, an attempt starts cold, exactly as before: a command that is not
`python -m MODULE` or `python SCRIPT.py`, several ranks (torchrun starts them), a pod, an
environment that changed since the standby started, a standby that died. Off with
`CKPT_WARM_TRAINER=0` (`Setting.WARM_TRAINER`); with `CKPT_IN_RUN_RELAUNCH=0` only the
first attempt's is started (no attempt is relaunched in its run).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass

from ckpt_assets.base.process_group import die_with_parent, stops_held
from ckpt_assets.lifecycle.settings import ResumeSettings
from trainer.process.standby import MODULE, Handoff, entry, own_trainer, standing_env

STANDBY_STARTED = "standby trainer started"  # the run's log line


@dataclass
class _Standby:
    proc: subprocess.Popen
    python: str
    env: dict[str, str]

    def unfit(self, handoff: Handoff) -> str | None:
        """Why this standby cannot become `handoff`'s attempt, or None when it can."""
        if self.proc.poll() is not None:
            return "it has exited"
        return handoff.unfit(self.python, self.env)


class WarmTrainer:
    """At most one standby; `take` hands it the attempt when it can become it."""

    def __init__(self, settings: ResumeSettings, log) -> None:
        self.enabled = settings.warm_trainer  # a standby for the run's first attempt
        self.refills = self.enabled and settings.in_run_relaunch  # and one for each relaunch
        self.log = log
        self._standby: _Standby | None = None

    def take(self, argv: list[str], env: dict[str, str], cwd: str,
             output: str) -> subprocess.Popen | None:
        """The standby, handed this attempt, if it can become it; else None (the caller
        starts the attempt cold, and an unfit standby is stopped)."""
        standby, self._standby = self._standby, None
        if standby is None:
            return None
        handoff = Handoff(list(argv), dict(env), cwd, output)
        unfit = standby.unfit(handoff)
        if unfit:
            self.log.info(f"the standby trainer cannot take this attempt ({unfit}); "
                          "starting it cold")
        else:
            try:
                standby.proc.stdin.write(handoff.to_line())
                standby.proc.stdin.close()
                return standby.proc
            except OSError as e:  # it died just now: start cold
                self.log.warning(f"the standby trainer (pid {standby.proc.pid}) could not "
                                 f"take the attempt over ({e}); starting it cold")
        _end(standby.proc)
        return None

    def warm_up(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        """Start the standby the run's first attempt, launched as `argv` in `env` and `cwd`
        (`ckpt_assets.attempt.command.standing_launch`), is to become."""
        if self.enabled:
            self._start(argv, env, cwd)

    def refill(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        """Start a standby for a relaunch of the attempt launched as `argv`, once it runs."""
        if self.refills:
            self._start(argv, env, cwd)

    def _start(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        """Start a standby unless there is one or it could not run `argv`. Called from the
        run's own thread (a step's): PR_SET_PDEATHSIG follows the thread that started a
        process, so a helper thread's exit would stop it."""
        if self._standby is not None or entry(argv) is None:
            return
        theirs = own_trainer(argv, cwd)
        if theirs is not None:
            self.log.info(f"no standby trainer: the attempt imports {theirs} as `trainer`, "
                          "which a standby's own `trainer` would hide; attempts start cold")
            return
        with stops_held() as held:
            try:  # recorded before a held stop is delivered: `close` ends it
                self._standby = start_standby(argv[0], env, cwd)
                self.log.info(f"{STANDBY_STARTED} (pid {self._standby.proc.pid}) for the "
                              "next attempt")
            except OSError as e:  # the next attempt starts cold; this one trains on
                self.log.warning(f"could not start a standby trainer ({e}); a relaunch "
                                 "starts cold")
        held.deliver()

    def close(self) -> None:
        standby, self._standby = self._standby, None
        if standby is not None:
            _end(standby.proc)


def start_standby(python: str, env: dict[str, str], cwd: str) -> _Standby:
    """A standby interpreter `python` in `env` (less the per-attempt names) and `cwd`, in a
    session of its own, dying with the thread that started it. Raises OSError. In a run's
    step, start it under `stops_held`."""
    proc = subprocess.Popen(
        [python, "-m", MODULE], env=standing_env(env), cwd=cwd,
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        start_new_session=True)
    return _Standby(proc, python, standing_env(env))


def _end(proc: subprocess.Popen) -> None:
    """Stop an unused standby: it holds no state, so SIGKILL, and reap it."""
    if proc.poll() is None:  # once reaped, its number may be another process's
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if proc.stdin:
        try:
            proc.stdin.close()
        except OSError:
            pass
    proc.wait()
