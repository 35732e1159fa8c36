"""The orchestrator's own settings: read from its environment each time they are needed, so
a changed variable takes effect at the daemon's next tick or the next step, not at import.
They are the deployment's defaults: a training run's registered config may set its own
(`resume:` keys, `trainer.config.ResumeConfig`), which `for_run` lays over them.

Apart from the decision that uses most of them (`ckpt_assets.lifecycle.decision`), so that the
assets and the in-run relaunch read them without importing the job and the sensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from enum import StrEnum

from ckpt_assets.base.registration import read_registration
from ckpt_assets.lifecycle.policy import PolicyConfig
from trainer.config import ResumeConfig
from trainer.storage import ObjectStore

# Gone: one budget now counts failures without progress (CKPT_MAX_TRANSIENT_FAILURES).
RETIRED = {"CKPT_CRASH_LOOP_BUDGET": "CKPT_MAX_TRANSIENT_FAILURES (failures in a row "
                                     "without the checkpoint advancing; default 3)"}


class Setting(StrEnum):
    """The orchestrator's own settings (the daemon's environment), read by `from_env`."""

    MAX_PREEMPTIONS = "CKPT_MAX_PREEMPTIONS"
    MAX_TRANSIENT = "CKPT_MAX_TRANSIENT_FAILURES"
    BACKOFF_BASE_S = "CKPT_BACKOFF_BASE_S"
    BACKOFF_MAX_S = "CKPT_BACKOFF_MAX_S"
    HEARTBEAT_TIMEOUT_S = "CKPT_HEARTBEAT_TIMEOUT_S"
    WORKER_GRACE_S = "CKPT_WORKER_GRACE_S"
    STALL_TIMEOUT_S = "CKPT_STALL_TIMEOUT_S"
    STOP_GRACE_S = "CKPT_STOP_GRACE_S"
    IN_RUN_RELAUNCH = "CKPT_IN_RUN_RELAUNCH"
    IN_RUN_MAX_DELAY_S = "CKPT_IN_RUN_MAX_DELAY_S"
    IN_RUN_PREEMPT_SETTLE_S = "CKPT_IN_RUN_PREEMPT_SETTLE_S"
    WARM_TRAINER = "CKPT_WARM_TRAINER"


@dataclass(frozen=True)
class ResumeSettings:
    """The orchestrator's resume settings, read from its environment when a sensor runs
    (so a changed variable takes effect at the daemon's next tick, not at import)."""

    policy: PolicyConfig = PolicyConfig()
    # A STARTED run whose trainer's heartbeat is older than this has lost its trainer.
    heartbeat_timeout_s: float = 120.0
    # ... and one that has had no live trainer for this long: none has beaten since the run
    # started, or its trainer ended this long ago. Apart from the timeout: the run worker's
    # own work before and after its trainer (the dataset's manifest, hashing a large local
    # dataset takes minutes; the trainer's imports; evaluating and exporting the final
    # model) says nothing about how often a live trainer beats.
    worker_grace_s: float = 300.0
    # A STARTED run whose trainer heartbeats but completed no step for this long is stalled.
    # Generous: a first step under torch.compile (minutes for a large model), a large
    # gradient accumulation or a cold first read of S3 data must not pass for a hang, and
    # a real hang costs at most this long before it is resumed.
    stall_timeout_s: float = 1800.0
    # A trainer declared dead or stalled gets this long after SIGTERM before SIGKILL.
    stop_grace_s: float = 10.0
    # A trainer that died while its run worker lives is relaunched in the same run
    # (`ckpt_assets.attempt.in_run`), serving back-offs up to this long by sleeping in the step.
    # On by default: a new run costs a failed-run detection, a sensor tick, the queue and a
    # new run worker (seconds to tens of seconds) for nothing the policy would decide
    # differently. Off (`CKPT_IN_RUN_RELAUNCH=0`), every failure goes through the sensors.
    in_run_relaunch: bool = True
    in_run_max_delay_s: float = 60.0
    # A trainer stopped by SIGTERM is relaunched in its run only if its run worker has not
    # been interrupted within this long of its end: a notice to the whole pod or node
    # reaches the worker too, within moments (`ckpt_assets.attempt.in_run`). The price of
    # telling the two apart, paid only by a preempted trainer's relaunch.
    in_run_preempt_settle_s: float = 2.0
    # ... by a standby process that imported torch while the attempt before it trained
    # (`ckpt_assets.attempt.warm_start`): one idle interpreter per training step, for a restart
    # about 2 s shorter. Off (`CKPT_WARM_TRAINER=0`), a relaunch starts cold.
    warm_trainer: bool = True

    def for_run(self, own: ResumeConfig | None) -> ResumeSettings:
        """These settings with a run's own `resume:` keys laid over them (None: none)."""
        if own is None:
            return self
        mine = {k: v for k, v in {
            "max_preemptions": own.max_preemptions,
            "max_transient": own.max_transient_failures,
            "backoff_base_s": own.backoff_base_seconds,
            "backoff_max_s": own.backoff_max_seconds}.items() if v is not None}
        settings = {k: v for k, v in {
            "heartbeat_timeout_s": own.heartbeat_timeout_seconds,
            "stall_timeout_s": own.stall_timeout_seconds,
            "in_run_relaunch": own.in_run_relaunch}.items() if v is not None}
        return replace(self, policy=replace(self.policy, **mine), **settings)

    def of_run(self, store: ObjectStore, run: str) -> ResumeSettings:
        """These settings as training run `run` registered them in `store`; the deployment's
        where it cannot be read (a decision or a liveness check must not wait on it)."""
        try:
            reg = read_registration(store, run)
        except Exception:  # unregistered, corrupt, the store down: its own error says so
            return self
        return self.for_run(reg.config.resume if reg is not None else None)

    @classmethod
    def from_env(cls) -> ResumeSettings:
        for name, instead in RETIRED.items():
            if os.environ.get(name, "").strip():
                raise ValueError(f"{name} is no longer read: unset it and set {instead} "
                                 "instead (or a run's own `resume:` keys)")
        env, p = os.environ.get, PolicyConfig()
        return cls(
            policy=PolicyConfig(
                max_preemptions=int(env(Setting.MAX_PREEMPTIONS, p.max_preemptions)),
                max_transient=int(env(Setting.MAX_TRANSIENT, p.max_transient)),
                backoff_base_s=float(env(Setting.BACKOFF_BASE_S, p.backoff_base_s)),
                backoff_max_s=float(env(Setting.BACKOFF_MAX_S, p.backoff_max_s))),
            heartbeat_timeout_s=float(env(Setting.HEARTBEAT_TIMEOUT_S, cls.heartbeat_timeout_s)),
            worker_grace_s=float(env(Setting.WORKER_GRACE_S, cls.worker_grace_s)),
            stall_timeout_s=float(env(Setting.STALL_TIMEOUT_S, cls.stall_timeout_s)),
            stop_grace_s=float(env(Setting.STOP_GRACE_S, cls.stop_grace_s)),
            in_run_relaunch=switch(Setting.IN_RUN_RELAUNCH, cls.in_run_relaunch),
            in_run_max_delay_s=float(env(Setting.IN_RUN_MAX_DELAY_S, cls.in_run_max_delay_s)),
            in_run_preempt_settle_s=float(env(Setting.IN_RUN_PREEMPT_SETTLE_S,
                                              cls.in_run_preempt_settle_s)),
            warm_trainer=switch(Setting.WARM_TRAINER, cls.warm_trainer))


SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True,
                "0": False, "false": False, "no": False, "off": False}


def switch(setting: Setting, default: bool) -> bool:
    """An on/off setting from the environment; unset or empty is `default`."""
    raw = os.environ.get(setting, "").strip().lower()
    if not raw:
        return default
    if raw not in SWITCH_WORDS:
        raise ValueError(f"{setting.value}={os.environ[setting]!r} is neither on nor off: set "
                         f"it to one of {', '.join(SWITCH_WORDS)} (or unset it for "
                         f"{'on' if default else 'off'})")
    return SWITCH_WORDS[raw]

