"""How an attempt of a training run ends: the one vocabulary of outcomes.

Every row of `Outcome` names one way an attempt can end, with the exit code that reports it
(when the trainer or the orchestrator has one), the `Kind` the failure policy decides on,
and so whether and how it is resumed. The trainer's errors, its exit status, the assets'
failure records, the policy, the sensors, the CLI and the README's table all read these
rows; nothing else spells an exit code or a class name.

Standalone (`trainer/` never imports dagster): the orchestrator imports it from here.
"""

from __future__ import annotations

import signal
from enum import Enum, StrEnum


class Resume(StrEnum):
    """How the policy treats a kind of failure."""

    AT_ONCE = "at once, within the preemption budget"
    WITH_BACKOFF = "with back-off, within the transient-failure budget"
    NEVER = "never"


class Kind(StrEnum):
    """What the failure policy decides on: outcomes grouped by what to do about them."""

    def __new__(cls, value: str, resume: Resume, advice: str):
        member = str.__new__(cls, value)
        member._value_ = value
        member.resume = resume
        member.advice = advice
        return member

    SUCCESS = ("success", Resume.NEVER, "the attempt finished the run")
    PREEMPTED = ("preempted", Resume.AT_ONCE, "the machine took the trainer away; it resumes")
    KILLED = ("killed", Resume.WITH_BACKOFF, "the process died; it resumes")
    STORAGE = ("storage", Resume.WITH_BACKOFF, "the store was unavailable; it resumes")
    STALLED = ("stalled", Resume.WITH_BACKOFF,
               "the trainer was alive but completed no step within the stall limit; it was "
               "stopped and resumes (if it stalls again at the same step, look for a hang: "
               "a collective waiting for a lost rank, a read without a timeout)")
    BAD_INPUT = ("bad_input", Resume.NEVER,
                 "bad config or input: fix the config and register a new run")
    CHECKPOINT = ("checkpoint", Resume.NEVER,
                  "no checkpoint of this run could be loaded (corrupt or incompatible)")
    DIVERGED = ("diverged", Resume.NEVER,
                "training diverged (NaN/inf loss): lower the learning rate or check the data")
    BUG = ("bug", Resume.NEVER,
           "an exception in the training code: fix it, then launch the run again")
    SUPERSEDED = ("superseded", Resume.NEVER, "a newer attempt owns this run; it carries on")
    NO_CHECKPOINT = ("no_checkpoint", Resume.NEVER,
                     "the command finished without committing a checkpoint; make it "
                     "checkpoint through trainer.CheckpointSession")
    UNFINISHED = ("unfinished", Resume.NEVER,
                  "the command's process exited 0 before its session committed the final "
                  "checkpoint (it forked the training off and exited, or left by os._exit): "
                  "make the process the orchestrator starts train to the end (exec, not "
                  "fork) and let it end normally")
    UNKNOWN = ("unknown", Resume.NEVER,
               "the failure could not be classified; inspect the run's logs")
    # Decisions that override a resumable kind (they name why nothing was resumed):
    CRASH_LOOP = ("crash_loop", Resume.NEVER,
                  "it failed again without its checkpoint step advancing; fix the cause, then "
                  "launch the run again")
    STOPPED_BY_USER = ("stopped_by_user", Resume.NEVER, "stopped on request")

    @property
    def resumable(self) -> bool:
        return self.resume is not Resume.NEVER


class Outcome(Enum):
    """One way an attempt ends. The value is the class name written in tags, metadata,
    Pipes messages and MLflow; `exit_code` is the trainer's (None: the orchestrator sees it
    some other way); `kind` is what the policy decides on."""

    def __init__(self, value: str, exit_code: int | None, kind: Kind, seen_as: str):
        self.exit_code = exit_code
        self.kind = kind
        self.seen_as = seen_as

    SUCCESS = ("success", 0, Kind.SUCCESS, "the trainer exited 0 after its final checkpoint")
    USER_CODE_ERROR = ("user_code_error", 1, Kind.BUG,
                       "any other error in the training code (its traceback is in the log)")
    BAD_INPUT = ("bad_input", 2, Kind.BAD_INPUT, "bad config or bad input (unknown key, wrong type or range, bad name, missing `--resume` checkpoint, unusable store path, a changed dataset)")
    CHECKPOINT_UNLOADABLE = ("checkpoint_unloadable", 3, Kind.CHECKPOINT,
                             "no checkpoint could be loaded (corrupt beyond fallback, unsafe, incompatible)")
    DIVERGED = ("diverged", 4, Kind.DIVERGED, "training diverged (NaN/inf loss)")
    STORAGE_UNAVAILABLE = ("storage_unavailable", 5, Kind.STORAGE,
                           "store unavailable after retries (S3 endpoint, timeouts, 5xx)")
    SUPERSEDED = ("superseded", 6, Kind.SUPERSEDED,
                  "superseded: a newer attempt of the same run took it over (fenced)")
    RANK_LOST = ("rank_lost", 7, Kind.KILLED,
                 "a multi-rank attempt lost a rank: a collective among the ranks failed "
                 "(a peer died) or passed `checkpoint.collective_timeout_s` (a peer hung), "
                 "or a rank sent its launcher no liveness beat for the heartbeat timeout "
                 "(frozen)")
    PREEMPTED = ("preempted", 143, Kind.PREEMPTED,
                 "stopped by SIGTERM/SIGINT after committing a checkpoint (or killed by one)")
    TERMINATED = ("terminated", None, Kind.PREEMPTED,
                  "the Dagster run was terminated (UI, CLI, run monitoring)")
    KILLED_BY_SIGNAL = ("killed_by_signal", None, Kind.KILLED,
                        "killed by a signal (SIGKILL, OOM killer, node loss): exit -9 or 137")
    WORKER_LOST = ("worker_lost", None, Kind.KILLED,
                   "the run worker died before recording how the trainer exited")
    HEARTBEAT_LOST = ("heartbeat_lost", None, Kind.KILLED,
                      "the trainer stopped heartbeating; the reconciler failed the run")
    STALLED = ("stalled", None, Kind.STALLED,
               "the trainer kept heartbeating but completed no step for "
               "`CKPT_STALL_TIMEOUT_S` (30 min); the reconciler stopped it and failed the run")
    NO_CHECKPOINT = ("no_checkpoint", 8, Kind.NO_CHECKPOINT,
                     "the script ended without training a step, so no checkpoint of the run "
                     "exists (or a command exited 0 without committing one)")
    UNFINISHED = ("unfinished", None, Kind.UNFINISHED,
                  "exited 0 before its session committed the final checkpoint (a command that "
                  "forked the training off and exited, or left by os._exit; a loop left early "
                  "still ends its session, which commits its last step as final); what it "
                  "left running was stopped")
    UNKNOWN = ("unknown", None, Kind.UNKNOWN, "an exit code nobody defines")
    # A stop for good ends the trainer as a preemption does (SIGTERM, exit 143): the exit
    # classifies the attempt; this names it where people read why it ended (MLflow).
    STOPPED_BY_USER = ("stopped_by_user", None, Kind.STOPPED_BY_USER,
                       "stopped for good on request (`ckpt-assets stop`, the "
                       "`stop_training_run` job): its trainer exits as on a preemption, and "
                       "the run is never resumed")

    def __new__(cls, value: str, *_: object):
        member = object.__new__(cls)
        member._value_ = value
        return member

    @property
    def failed(self) -> bool:
        return self is not Outcome.SUCCESS

    @classmethod
    def parse(cls, name: str | None) -> Outcome | None:
        """The outcome a recorded class name stands for (None: not one of ours)."""
        try:
            return cls(name)
        except ValueError:
            return None

    @classmethod
    def of_exit(cls, rc: int, reported: str | None = None) -> Outcome:
        """The outcome of a process that exited `rc` (Popen's -N for a signal, or a shell's
        128+N); the trainer's own report wins when it made one, except a lost rank's echo."""
        if rc == 0:
            return cls.SUCCESS
        if (known := cls.parse(reported)) is not None:
            if known is not cls.RANK_LOST or rc == known.exit_code:
                return known
            # Rank 0 reported losing a peer; the launcher's exit status names why the peer
            # went (`trainer.ranks.world.attempt_exit`): a bug there is a bug, not a lost rank.
        if rc in BY_EXIT_CODE:
            return BY_EXIT_CODE[rc]
        if rc in BY_EXIT_CODE:
            return BY_EXIT_CODE[rc]
        sig = signal_of(rc)
        if sig is not None:
            return cls.PREEMPTED if sig in STOP_SIGNALS else cls.KILLED_BY_SIGNAL
        return cls.UNKNOWN


BY_EXIT_CODE = {o.exit_code: o for o in Outcome if o.exit_code is not None}
# Signals that ask a process to stop (a preemption notice), as opposed to killing it.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signal_of(rc: int) -> int | None:
    """The signal behind an exit status (-N from Popen, or a shell's 128+N)."""
    if rc < 0:
        return -rc
    return rc - 128 if 128 < rc < 160 else None


def signal_name(rc: int) -> str | None:
    num = signal_of(rc)
    if num is None:
        return None
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def outcome_table() -> str:
    """The README's table of outcomes, from the rows above (a test keeps them equal)."""
    rows = ["| exit | class | what happened | policy kind | resumed |",
            "| --- | --- | --- | --- | --- |"]
    for o in Outcome:
        code = "–" if o.exit_code is None else str(o.exit_code)
        resumed = "–" if o is Outcome.SUCCESS else str(o.kind.resume)
        rows.append(f"| {code} | `{o.value}` | {o.seen_as} | `{o.kind}` | {resumed} |")
    return "\n".join(rows)
