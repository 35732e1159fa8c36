"""The failure policy: which failed training runs are worth resuming, and when.

Pure functions over plain data, so every rule is unit-tested without a Dagster instance;
the sensors (`ckpt_assets.sensors`) gather the facts and act on the decision.

| kind          | seen as                                         | decision                   |
|---------------|-------------------------------------------------|----------------------------|
| preempted     | exit 143, SIGTERM/SIGINT, run terminated        | resume (preemption budget) |
| killed        | exit -9/137, run worker or code server gone     | resume (transient budget)  |
| storage       | exit 5 (store unreachable after retries)        | resume with back-off       |
| bad_input     | exit 2                                          | never                      |
| checkpoint    | exit 3 (no checkpoint could be loaded)          | never; alert               |
| diverged      | exit 4 (NaN/inf loss)                           | never; alert               |
| bug           | exit 1 (exception in training code)             | never; alert               |
| superseded    | exit 6 (a newer attempt owns the run)           | never (that attempt goes on)|
| crash loop    | fails again without its checkpoint step moving  | stop after a small budget  |
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

RESUMABLE = {"preempted", "killed", "storage"}
NEVER = {
    "bad_input": "bad config or input: fix the config and register a new run",
    "checkpoint": "no checkpoint of this run could be loaded (corrupt or incompatible)",
    "diverged": "training diverged (NaN/inf loss): lower the learning rate or check the data",
    "bug": "an exception in the training code: fix it, then launch the run again",
    "superseded": "a newer attempt owns this run; it carries on",
    "unknown": "the failure could not be classified; inspect the run's logs",
}
_EXIT_KINDS = {143: "preempted", 130: "preempted", 2: "bad_input", 3: "checkpoint",
               4: "diverged", 1: "bug", 5: "storage", 6: "superseded", 137: "killed"}
_CLASS_KINDS = {"preempted": "preempted", "bad_input": "bad_input",
                "checkpoint_unloadable": "checkpoint", "diverged": "diverged",
                "user_code_error": "bug", "storage_unavailable": "storage",
                "superseded": "superseded", "killed_by_signal": "killed",
                "worker_lost": "killed", "heartbeat_lost": "killed", "interrupted": "preempted"}


@dataclass(frozen=True)
class Failure:
    """What is known about one failed attempt of a training run."""

    run_id: str
    partition: str
    attempt: int = 1
    exit_code: int | None = None  # the trainer's; negative = killed by that signal
    failure_class: str | None = None  # as reported by the trainer or the asset
    last_committed_step: int | None = None
    worker_lost: bool = False  # the run worker died: no step failure was recorded
    canceled: bool = False  # terminated from Dagster (UI, CLI, run monitoring)


@dataclass(frozen=True)
class PolicyConfig:
    max_preemptions: int = 50
    max_transient: int = 3
    crash_loop_budget: int = 2  # failures in a row at one checkpoint step before we stop
    backoff_base_s: float = 5.0
    backoff_max_s: float = 300.0


@dataclass(frozen=True)
class Decision:
    resume: bool
    kind: str
    reason: str
    delay_s: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)


def classify(f: Failure) -> str:
    if f.failure_class in _CLASS_KINDS:
        kind = _CLASS_KINDS[f.failure_class]
        if kind == "killed" and f.exit_code is not None and f.exit_code < 0:
            sig = -f.exit_code
            return "preempted" if sig in (signal.SIGTERM, signal.SIGINT) else "killed"
        return kind
    if f.exit_code is not None:
        if f.exit_code < 0:
            return "preempted" if -f.exit_code in (signal.SIGTERM, signal.SIGINT) else "killed"
        if f.exit_code in _EXIT_KINDS:
            return _EXIT_KINDS[f.exit_code]
        if f.exit_code > 128:  # a shell's way of saying "killed by signal N"
            return "preempted" if f.exit_code - 128 == signal.SIGTERM else "killed"
    if f.canceled:
        return "preempted"
    if f.worker_lost:
        return "killed"
    return "unknown"


def decide(failure: Failure, earlier: list[Failure], cfg: PolicyConfig = PolicyConfig()) -> Decision:
    """Resume `failure`? `earlier` are the run's previous failures, oldest first."""
    kind = classify(failure)
    chain = [*earlier, failure]
    kinds = [classify(f) for f in chain]
    counts = {"preemptions": kinds.count("preempted"),
              "transient": sum(k in ("killed", "storage") for k in kinds),
              "failures": len(chain)}
    if kind not in RESUMABLE:
        return Decision(False, kind, f"not resumed: {NEVER.get(kind, NEVER['unknown'])}",
                        counts=counts)

    # Crash loop: the same step, failure after failure. Preemptions stopping before the
    # first checkpoint are not a loop (the machine, not the run, is at fault).
    stuck = 0
    for f, k in zip(reversed(chain), reversed(kinds), strict=True):
        if k == "preempted" or f.last_committed_step != failure.last_committed_step:
            break
        stuck += 1
    counts["same_step"] = stuck
    if kind != "preempted" and stuck > cfg.crash_loop_budget:
        return Decision(False, "crash_loop",
                        f"not resumed: crash loop, {stuck} failures in a row without the "
                        f"checkpoint advancing past step {failure.last_committed_step}; fix the "
                        "cause, then launch the run again", counts=counts)
    if kind == "preempted":
        if counts["preemptions"] > cfg.max_preemptions:
            return Decision(False, "preempted", f"not resumed: preempted {counts['preemptions']} "
                            f"times, over the budget of {cfg.max_preemptions}", counts=counts)
        return Decision(True, kind, f"resumed: preemption #{counts['preemptions']} (budget "
                        f"{cfg.max_preemptions})", counts=counts)
    if counts["transient"] > cfg.max_transient:
        return Decision(False, kind, f"not resumed: {counts['transient']} {kind} failures, over "
                        f"the budget of {cfg.max_transient}", counts=counts)
    delay = min(cfg.backoff_max_s, cfg.backoff_base_s * 2 ** (counts["transient"] - 1))
    return Decision(True, kind, f"resumed after {delay:.0f}s: {kind} failure "
                    f"#{counts['transient']} (budget {cfg.max_transient})", delay_s=delay,
                    counts=counts)
