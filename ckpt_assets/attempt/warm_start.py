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

A standby is handed an attempt only once it has shown itself alive and answering
(`_Standby.answers`): one that was stopped (SIGSTOP, a debugger) or died is replaced by a
fresh start of the trainer, never waited on.

What it costs: one idle interpreter with torch and Dynamo imported (about 370 MB resident,
no CPU once imported) for as long as the step trains, and nothing when it is not used. It is
stopped when the step ends, and it ends by itself when the step's process dies (its stdin
closes; PR_SET_PDEATHSIG as a trainer has).

Where it is not used, an attempt starts cold, exactly as before: a command that is not
`python -m MODULE` or `python SCRIPT.py`, several ranks (torchrun starts them), a pod, an
environment that changed since the standby started, a standby that died, was stopped or
does not answer. Off with `CKPT_WARM_TRAINER=0` (`Setting.WARM_TRAINER`); with
`CKPT_IN_RUN_RELAUNCH=0` only the first attempt's is started (no attempt is relaunched in
its run).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ckpt_assets.base.child_start import die_with_parent, stops_held
from ckpt_assets.lifecycle.settings import ResumeSettings
from trainer.base.process_id import EXITED, STOPPED, process_state
from trainer.process.standby import MODULE, PING, PONG, Handoff, entry, own_trainer, standing_env

STANDBY_STARTED = "standby trainer started"  # the run's log line

# How long a standby that has had time to import may take to answer a ping: one idle in its
# read answers within milliseconds; two seconds cover a busy machine's scheduling.
ANSWER_S = 2.0
# How long after its start a standby may still be importing (no answer yet) and be waited
# for: a fresh interpreter would import no faster, and one started ahead is further along.
IMPORT_S = 60.0
LOOK_S = 0.02  # how often a wait for the answer looks at the standby's state


@dataclass
class _Standby:
    proc: subprocess.Popen
    python: str
    env: dict[str, str]
    started: float = field(default_factory=time.monotonic)
    pings: int = 0  # asked so far; an answer counts only once every ping has one
    replies: bytes = b""

    def unfit(self, handoff: Handoff) -> str | None:
        """Why this standby, alive or not, could not become `handoff`'s attempt, or None."""
        return handoff.unfit(self.python, self.env)

    def answers(self) -> str | None:
        """Why this standby is not alive and answering now, or None once it answered a ping.

        Alive is the kernel's word, read from /proc: a stopped process (SIGSTOP, a debugger:
        state T or t) or a dead one is given up at once, as it would never read the attempt
        written to it, which would then wait, unseen, for the liveness sweep. Answering is the
        standby's own: a ping line on its stdin, which it reads only once its imports are done,
        answered on its stdout. So a standby still importing is waited for (a fresh start would
        import no faster), up to `IMPORT_S` from its start; past that it must answer within
        `ANSWER_S`, which a process that is alive but stuck (a frozen cgroup, a hung import)
        does not. Neither alone would do: /proc cannot tell stuck from idle, and a ping alone
        would wait its whole deadline on a stopped process."""
        if (gone := self._gone()) is not None:
            return gone
        try:
            self.proc.stdin.write(PING)
            self.proc.stdin.flush()
        except OSError as e:  # only a process that exits closes its end of the pipe
            return f"it has exited ({e})"
        self.pings += 1
        asked = time.monotonic()
        deadline = max(asked + ANSWER_S, self.started + IMPORT_S)
        while True:
            if (gone := self._gone()) is not None:
                return gone
            readable, _, _ = select.select([self.proc.stdout], [], [], LOOK_S)
            if readable:
                chunk = os.read(self.proc.stdout.fileno(), 64)
                if not chunk:  # only a process that exits closes it before its handoff
                    return "it has exited (its output closed)"
                self.replies += chunk
                if self.replies.count(PONG) >= self.pings:
                    return None
            if time.monotonic() >= deadline:
                return f"it did not answer within {time.monotonic() - asked:.1f}s"

    def _gone(self) -> str | None:
        """Why the kernel says this standby will never read a line, or None (where there is
        no /proc, only the ping's deadline tells a stopped standby)."""
        state = process_state(self.proc.pid)
        # A zombie (Z) is not yet reapable while its other threads (torch's) still exit.
        if self.proc.poll() is not None or state in EXITED:
            return "it has exited"
        if state in STOPPED:
            return f"it is stopped (state {state}: SIGSTOP or a debugger)"
        return None


class WarmTrainer:
    """At most one standby; `take` hands it the attempt when it can become it."""

    def __init__(self, settings: ResumeSettings, log) -> None:
        self.enabled = settings.warm_trainer  # a standby for the run's first attempt
        self.refills = self.enabled and settings.in_run_relaunch  # and one for each relaunch
        self.log = log
        self._standby: _Standby | None = None

    def ready(self, argv: list[str], env: dict[str, str], cwd: str) -> None:
        """Keep the standby only if it can become the attempt launched as `argv` in `env` and
        `cwd` now: it fits that launch, and it is alive and answering. Any other is stopped,
        and the attempt starts cold. May wait for a standby still importing, so call it before
        stops are held for the attempt's start; `take` asks again (answered at once)."""
        standby = self._standby
        if standby is None:
            return
        unfit = standby.unfit(Handoff(list(argv), dict(env), cwd, ""))
        if unfit:
            self.log.info(f"the standby trainer cannot take this attempt ({unfit}); "
                          "starting it cold")
        elif why := standby.answers():
            unfit = why
            self.log.warning(f"the standby trainer (pid {standby.proc.pid}) is replaced by a "
                             f"fresh start of the trainer: {why}")
        if unfit:
            self._standby = None
            _end(standby.proc)

    def take(self, argv: list[str], env: dict[str, str], cwd: str,
             output: str) -> subprocess.Popen | None:
        """The standby, handed this attempt, if it can become it (`ready`); else None (the
        caller starts the attempt cold, and the standby is stopped)."""
        self.ready(argv, env, cwd)
        standby, self._standby = self._standby, None
        if standby is None:
            return None
        try:
            standby.proc.stdin.write(Handoff(list(argv), dict(env), cwd, output).to_line())
            standby.proc.stdin.close()
            standby.proc.stdout.close()  # the attempt writes to its output file
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
        process, so a helper thread's exit would stop it. A refusal is said once: the run
        asks for a refill every few tenths of a second, and then stops asking."""
        if self._standby is not None or entry(argv) is None:
            return
        theirs = own_trainer(argv, cwd)
        if theirs is not None:
            self.refills = False
            self.log.info(f"no standby trainer: the attempt imports {theirs} as `trainer`, "
                          "which a standby's own `trainer` would hide; attempts start cold")
            return
        with stops_held() as held:
            try:  # recorded before a held stop is delivered: `close` ends it
                self._standby = start_standby(argv[0], env, cwd)
                self.log.info(f"{STANDBY_STARTED} (pid {self._standby.proc.pid}) for the "
                              "next attempt")
            except OSError as e:  # the next attempt starts cold; this one trains on
                self.refills = False
                self.log.warning(f"could not start a standby trainer ({e}); relaunches in "
                                 "this run start cold")
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
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        start_new_session=True)
    return _Standby(proc, python, standing_env(env))


def _end(proc: subprocess.Popen) -> None:
    """Stop an unused standby: it holds no state, so SIGKILL (which ends a stopped process
    too), and reap it."""
    if proc.poll() is None:  # once reaped, its number may be another process's
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pipe in (proc.stdin, proc.stdout):
        if pipe:
            try:
                pipe.close()
            except OSError:
                pass
    proc.wait()
