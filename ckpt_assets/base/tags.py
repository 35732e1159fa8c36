"""Every run tag ckpt-assets writes, in one place: few, and each one read by something.

Besides these, every training run carries Dagster's own `dagster/partition` (the training
run) and `dagster/max_retries: 0` (resuming is the sensors' decision, made once per failure).
"""

PARTITION_TAG = "dagster/partition"  # Dagster's own: the partition (training run) of a run

# On a resume run (set by the resume sensors; they chain the attempts):
TAG_PARENT_RUN_ID = "ckpt/parent_run_id"  # the failed run it resumes
TAG_ROOT_RUN_ID = "ckpt/root_run_id"  # the training run's first Dagster run
TAG_ATTEMPT = "ckpt/attempt"  # the attempt number it asks for
TAG_RESUME_FROM = "ckpt/resume_from"  # the checkpoint URI, or "latest"
TAG_ATTEMPT_STARTED_AT = "ckpt/attempt_started_at"  # ISO 8601: an in-run relaunch's start
TAG_BUDGET = "ckpt/budget"  # what the chain used so far (`policy.Budget.to_tag`)
# The chain's attempts before this run's current one, each by its outcome's one name
# ("1:terminated,2:killed_by_signal"): set on a resume (from the decision's record), on a
# launch by hand after a failure, and by an in-run relaunch. `list` and the state check
# name an interrupted attempt from it once a later attempt is the run's latest.
TAG_INTERRUPTED = "ckpt/interrupted"
INTERRUPTED_KEPT = 50  # the newest entries kept: a long chain's tag stays short


def interrupted_of(text: str | None) -> dict[int, str]:
    """{attempt: outcome} of an interrupted tag, oldest first; malformed entries left out."""
    out = {}
    for item in (text or "").split(","):
        number, _, name = item.partition(":")
        if number.strip().isdigit() and name.strip():
            out[int(number)] = name.strip()
    return out


def interrupted_tag(before: dict[int, str], ended: tuple[int, str] | None = None) -> str:
    """The interrupted tag of `before`, with `ended` ((attempt, outcome)) added."""
    items = sorted({**before, **dict([ended] if ended else [])}.items())[-INTERRUPTED_KEPT:]
    return ",".join(f"{n}:{name}" for n, name in items)

# On any training run, set by a launch that asks for another world size than the registered
# config's (`ckpt-assets launch --nproc-per-node/--nnodes`), and carried by its resumes:
TAG_NPROC_PER_NODE = "ckpt/nproc_per_node"
TAG_NNODES = "ckpt/nnodes"
# The registered config's `distributed` key each of them replaces.
WORLD_TAGS = {"nproc_per_node": TAG_NPROC_PER_NODE, "nnodes": TAG_NNODES}


def world_tags(world: dict[str, str]) -> dict[str, str]:
    """The run tags that ask for `world` (`distributed` keys of WORLD_TAGS -> values)."""
    return {WORLD_TAGS[key]: value for key, value in world.items()}


def world_of(tags: dict[str, str]) -> dict[str, str]:
    """The world size a run's tags ask for (what its resumes carry), by `distributed` key."""
    return {key: tags[tag] for key, tag in WORLD_TAGS.items() if tags.get(tag)}

# On an ended training run (set by the resume sensors when they decide):
TAG_DECISION = "ckpt/decision"  # "resume" | "stop"
TAG_DECISION_REASON = "ckpt/decision_reason"  # in words
TAG_FAILURE_KIND = "ckpt/failure_kind"  # the policy's class: preempted, killed, bug, ...
TAG_FAILURE_CLASS = "ckpt/failure_class"  # the outcome: `trainer.base.outcomes.Outcome`'s name
TAG_DECIDED_AT = "ckpt/decided_at"  # ISO 8601, UTC
TAG_RESUME_AT = "ckpt/resume_at"  # ISO 8601, UTC; only for a resume after a back-off
TAG_NEXT_BUDGET = "ckpt/next_budget"  # the budget its resume will carry
TAG_RESUMED_BY = "ckpt/resumed_by"  # the run that resumed it (set by that run)
# Set by the reconciler before it fails a STARTED run whose trainer stopped heartbeating:
TAG_HEARTBEAT_LOST = "ckpt/heartbeat_lost"  # the heartbeat's age when it gave up, in words
# Set by whoever finds a STARTED run whose run worker died, before it fails the run:
TAG_WORKER_LOST = "ckpt/worker_lost"  # what was found, in words

# On a training run while its step runs (`ckpt_assets.base.attempt_processes.AttemptProcesses`):
TAG_PROCESSES = "ckpt/processes"  # its run worker, process group (each a ProcessId), output
# ... or one whose trainer heartbeats but completed no step within the stall limit:
TAG_STALLED = "ckpt/stalled"  # the step's age when it gave up, in words

# On a run stopped for good (`ckpt_assets.lifecycle.stop`):
TAG_NO_RESUME = "ckpt/no_resume"  # "true"
TAG_STOP_REASON = "ckpt/stop_reason"  # free text from the user

# On other runs:
TAG_CHECKED_RUN = "ckpt/checked_run_id"  # a check run: the training run it checks
TAG_STOP_TARGET = "ckpt/stop_target"  # a stop_training_run run: the training run it stopped
TAG_NEW_RUN_TARGET = "ckpt/new_run_target"  # a new_training_run run: the run it launched
