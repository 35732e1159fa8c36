"""The failure policy: which failed training runs are worth resuming, and when.

Pure functions over plain data, so every rule is unit-tested without a Dagster instance;
the sensors (`ckpt_assets.defs.sensors`) gather the facts into one `AttemptEnd` and act on the
decision. What each outcome is and whether it is resumed is `trainer.base.outcomes` (the
README's table is generated from it); what is decided here is the budgets: preemptions,
transient failures with back-off, and the crash loop (a chain that fails again without a
new highest checkpoint step stops after a small budget).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from ckpt_assets.base.end import AttemptEnd
from trainer.base.outcomes import Kind, Resume


@dataclass(frozen=True)
class PolicyConfig:
    max_preemptions: int = 50
    max_transient: int = 3
    crash_loop_budget: int = 2  # failures in a row without the checkpoint step advancing
    # A transient failure after progress resumes at once; one in a row at the same step
    # waits 10s, the next 20s, ... (the crash-loop budget usually stops it before).
    backoff_base_s: float = 10.0
    backoff_max_s: float = 300.0


@dataclass(frozen=True)
class Budget:
    """What a chain of attempts has used up so far; carried on each resume run's tags."""

    preemptions: int = 0
    transient: int = 0
    stuck: int = 0  # failures in a row whose attempt did not move the checkpoint step
    resumed_from_step: int | None = None  # checkpoint step the failed attempt started from
    # The highest checkpoint step any attempt of the chain committed. Progress is a new high:
    # after a walk-back past a corrupt checkpoint the pointer's step goes down, and a chain
    # that keeps re-committing the same steps must not pass for one that advances.
    high_step: int | None = None

    def to_tag(self) -> str:
        """`preemptions=1 transient=0 stuck=0 resumed_from_step=30 high_step=30`: readable in
        a run's tags (None fields are left out)."""
        return " ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                        if getattr(self, f.name) is not None)

    @classmethod
    def from_tag(cls, text: str) -> Budget:
        """Parse `to_tag`'s text (or the JSON older runs carry); anything unreadable is a
        fresh budget, as for a run that carries none."""
        text = (text or "").strip()
        try:
            if text.startswith("{"):
                values = json.loads(text)
            else:
                values = dict(item.split("=", 1) for item in text.split())
            known = {f.name for f in fields(cls)}
            return cls(**{k: int(v) for k, v in values.items() if k in known and v is not None})
        except (TypeError, ValueError):
            return cls()


@dataclass(frozen=True)
class Decision:
    resume: bool
    kind: Kind
    reason: str
    delay_s: float = 0.0
    budget: Budget = Budget()  # to carry on the resume run


def advancing(step: int | None, high: int | None, first: bool) -> bool:
    """Did the failed attempt move the run forward? Only a committed step above every step
    the chain committed before (`high`) counts: one that stayed, went down (a walk-back) or
    cannot be read (None) does not. A chain's first failure without any checkpoint yet is
    given the benefit of the doubt (`first`)."""
    if step is None:
        return first
    return high is None or step > high


def decide(failure: AttemptEnd, used: Budget = Budget(),
           cfg: PolicyConfig = PolicyConfig()) -> Decision:
    """Resume `failure`, given what its chain of attempts has `used` so far?"""
    kind = failure.kind
    step = failure.last_committed_step
    high = used.high_step if used.high_step is not None else used.resumed_from_step
    advanced = advancing(step, high, first=high is None and used.stuck == 0
                         and used.transient == 0)
    budget = Budget(
        preemptions=used.preemptions + (kind.resume is Resume.AT_ONCE),
        transient=used.transient + (kind.resume is Resume.WITH_BACKOFF),
        # A preemption is the machine's fault, not the run's: it neither adds to nor resets
        # the count of failures in a row at one step.
        stuck=used.stuck if kind.resume is Resume.AT_ONCE else (0 if advanced
                                                                else used.stuck + 1),
        resumed_from_step=step,
        high_step=max((s for s in (high, step) if s is not None), default=None),
    )
    if not kind.resumable:
        return Decision(False, kind, f"not resumed: {kind.advice}", budget=budget)
    if budget.stuck >= cfg.crash_loop_budget:
        return Decision(False, Kind.CRASH_LOOP,
                        f"not resumed: crash loop, {budget.stuck + 1} failures in a row without "
                        f"the checkpoint advancing past step {step}; fix the cause, then launch "
                        "the run again", budget=budget)
    if kind.resume is Resume.AT_ONCE:
        if budget.preemptions > cfg.max_preemptions:
            return Decision(False, kind, f"not resumed: preempted {budget.preemptions} times, "
                            f"over the budget of {cfg.max_preemptions}", budget=budget)
        return Decision(True, kind, f"resumed at once: preemption #{budget.preemptions} "
                        f"(budget {cfg.max_preemptions})", budget=budget)
    if budget.transient > cfg.max_transient:
        return Decision(False, kind, f"not resumed: {budget.transient} transient failures, over "
                        f"the budget of {cfg.max_transient}", budget=budget)
    return Decision(True, kind, f"resumed {_backoff_words(budget, cfg, step)}: {kind} failure "
                    f"#{budget.transient} (budget {cfg.max_transient})",
                    delay_s=_backoff_s(budget, cfg), budget=budget)


def _backoff_s(budget: Budget, cfg: PolicyConfig) -> float:
    """A back-off is for a failure that repeats without progress (a store still down, a
    node that keeps dying at the same point): it doubles with each failure in a row at one
    step. A failure after the run advanced is independent of the ones before, and every
    second of waiting is training lost (at a mean time between failures of 2 minutes, a
    10 s back-off per failure costs 8% of the run), so it resumes at once."""
    if budget.stuck == 0:
        return 0.0
    return min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (budget.stuck - 1))


def _backoff_words(budget: Budget, cfg: PolicyConfig, step: int | None) -> str:
    delay = _backoff_s(budget, cfg)
    if delay == 0:
        return "at once"
    return (f"after {delay:.0f}s ({budget.stuck} failure(s) in a row without the checkpoint "
            f"advancing past step {step})")
