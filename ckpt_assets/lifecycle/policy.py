"""The failure policy: which failed training runs are worth resuming, and when.

Pure functions over plain data, so every rule is unit-tested without a Dagster instance;
the sensors (`ckpt_assets.defs.sensors`) gather the facts into one `AttemptEnd` and act on the
decision. What each outcome is and whether it is resumed is `trainer.base.outcomes` (the
README's table is generated from it); what is decided here is the budgets.

A budget is spent by failures *without progress* and given back by progress (a new highest
committed checkpoint step): a week-long job that keeps committing keeps being resumed
however many processes it loses, and one that fails again and again without committing
(a crash loop, a store that stays down, a node that dies at the same point) is stopped
after a few tries. Preemptions have a budget of their own (the machine's fault, not the
run's), also counted since the last progress.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from ckpt_assets.base.end import AttemptEnd
from trainer.base.outcomes import Kind, Resume


@dataclass(frozen=True)
class PolicyConfig:
    # Preemptions since the checkpoint last advanced.
    max_preemptions: int = 50
    # Transient failures (killed, storage, stalled) in a row without the checkpoint
    # advancing; one more stops the run as a crash loop. Three: at a mean time between
    # failures of a minute and a checkpoint every 10 s, a run that does progress loses four
    # attempts in a row before committing once in about 1,000 failures.
    max_transient: int = 3
    # The first failure without progress waits 10 s, the next 20 s, ... (none after progress).
    backoff_base_s: float = 10.0
    backoff_max_s: float = 300.0


@dataclass(frozen=True)
class Budget:
    """What a chain of attempts has used of its budgets since its checkpoint last advanced;
    carried on each resume run's tags."""

    preemptions: int = 0  # since the checkpoint last advanced
    transient: int = 0  # transient failures in a row without the checkpoint advancing
    resumed_from_step: int | None = None  # checkpoint step the failed attempt started from
    # The highest checkpoint step any attempt of the chain committed. Progress is a new high:
    # after a walk-back past a corrupt checkpoint the pointer's step goes down, and a chain
    # that keeps re-committing the same steps must not pass for one that advances.
    high_step: int | None = None
    # Every failure of the chain, for the record (no budget): also tells a chain's first
    # failure, given the benefit of the doubt when it has no checkpoint yet.
    failures: int = 0

    def to_tag(self) -> str:
        """`preemptions=1 transient=0 resumed_from_step=30 high_step=30 failures=4`: readable
        in a run's tags (None fields are left out)."""
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
    """Resume `failure`, given what its chain of attempts has `used` since it last advanced?"""
    kind = failure.kind
    step = failure.last_committed_step
    high = used.high_step if used.high_step is not None else used.resumed_from_step
    advanced = advancing(step, high, first=high is None and used.failures == 0)
    since = Budget() if advanced else used  # progress gives every budget back
    budget = Budget(
        preemptions=since.preemptions + (kind.resume is Resume.AT_ONCE),
        # A preemption is the machine's fault, not the run's: it adds nothing to the count
        # of failures in a row without progress. A failure after progress counts nothing.
        transient=since.transient + (kind.resume is Resume.WITH_BACKOFF and not advanced),
        resumed_from_step=step,
        high_step=max((s for s in (high, step) if s is not None), default=None),
        failures=used.failures + 1,
    )
    if not kind.resumable:
        return Decision(False, kind, f"not resumed: {kind.advice}", budget=budget)
    where = _since_words(budget.high_step)
    if kind.resume is Resume.AT_ONCE:
        if budget.preemptions > cfg.max_preemptions:
            return Decision(False, kind, f"not resumed: preempted {budget.preemptions} times "
                            f"{where}, over the budget of {cfg.max_preemptions}", budget=budget)
        return Decision(True, kind, f"resumed at once: preemption {budget.preemptions} of "
                        f"{cfg.max_preemptions} {where}", budget=budget)
    if budget.transient > cfg.max_transient:
        return Decision(False, Kind.CRASH_LOOP,
                        f"not resumed: crash loop, {budget.transient} {kind} failures in a row "
                        f"{where}, over the budget of {cfg.max_transient}; fix the cause, "
                        "then launch the run again", budget=budget)
    if advanced:
        progress = (f"after progress to step {step}" if step is not None
                    else "before its first checkpoint (a first failure: given the doubt)")
        return Decision(True, kind, f"resumed at once: {kind} {progress} (budget of "
                        f"{cfg.max_transient} failures without progress untouched)",
                        budget=budget)
    return Decision(True, kind, f"resumed {_backoff_words(budget, cfg)}: {kind} failure "
                    f"{budget.transient} of {cfg.max_transient} {where}",
                    delay_s=_backoff_s(budget, cfg), budget=budget)


def _since_words(high: int | None) -> str:
    return "without a checkpoint yet" if high is None else f"since step {high}"


def _backoff_s(budget: Budget, cfg: PolicyConfig) -> float:
    """A back-off is for a failure that repeats without progress (a store still down, a
    node that keeps dying at the same point): it doubles with each failure in a row without
    progress. A failure after the run advanced is independent of the ones before, and every
    second of waiting is training lost (at a mean time between failures of 2 minutes, a
    10 s back-off per failure costs 8% of the run), so it resumes at once."""
    if budget.transient == 0:
        return 0.0
    return min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (budget.transient - 1))


def _backoff_words(budget: Budget, cfg: PolicyConfig) -> str:
    delay = _backoff_s(budget, cfg)
    return "at once" if delay == 0 else f"after {delay:.0f}s"
