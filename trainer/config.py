"""Training config: a JSON/YAML file checked strictly against these pydantic models.

Unknown keys, wrong types and values out of range are refused with the path of the
offending key, so a typo never silently trains with a default and a value the optimizer
would refuse never gets as far as a traceback. The models are also the source of the
orchestrator's typed launch form: their descriptions and defaults are what it shows.

A config runs one of two ways: a `task` (`package.module:function`, the trainer owns the
loop) or a `command` (the user's own script, which owns its loop and checkpoints through
`trainer.CheckpointSession`); only the orchestrator starts commands.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .base.errors import ConfigError
from .base.interval import AUTO
from .base.strict_json import non_finite_path
from .checkpoints.manifest import MAX_STEP
from .process.contract import RESERVED_PREFIXES, Env, reserved
from .storage import validate_name

MAX_HEARTBEAT_S = 60.0
# The longest a collective may wait for a peer (a day): a bound, never a hang.
MAX_COLLECTIVE_S = 86400.0
# NumPy's seeds are 32-bit: the widest range that seeds Python, NumPy and torch alike.
MAX_SEED = 2**32 - 1
# More threads or DataLoader workers than any machine runs: a typo, and torch would try to
# start them all (beyond 2**31 - 1 it refuses the number outright).
MAX_PARALLEL = 1024


def rendezvous_problem(endpoint: str) -> str | None:
    """What is wrong with a rendezvous endpoint (None: a HOST:PORT torchrun can use)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return (f"rendezvous endpoint {endpoint!r} is not HOST:PORT (a port from 1 to 65535 "
                "on node 0, reachable from every node), e.g. 10.0.0.5:29400")
    return None
# AdamW divides the learning rate by 1 - beta1 (down to about 1e-16) and multiplies it by
# the weight decay; the results must fit a float32 parameter (3.4e38) or the step raises.
MAX_LR = 1e6
MAX_WEIGHT_DECAY = 1e6
# task_args are the task's keyword arguments: a few levels of nesting at most. A bound far
# above that keeps every recursive walk of the config (JSON, YAML, hashing) clear of
# Python's recursion limit, so a hostile file is refused by name, not by a traceback.
MAX_TASK_ARGS_DEPTH = 32
# `package.module:function`: dotted identifiers, then one identifier. Anything else (a
# path, a relative module, an empty name) is refused here rather than by importlib's
# TypeError or ValueError.
TASK_SPEC = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
# The devices the trainer runs on (`trainer.device.resolve_device`).
DEVICE_SPEC = re.compile(r"auto|cpu|cuda(:\d{1,4})?")


class Section(BaseModel):
    """Strict: no unknown keys, no coercion (\"32\" is not 32, 1.5 is not an integer), no
    NaN or infinity."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              validate_default=True)


class OptimConfig(Section):
    lr: float = Field(3e-3, gt=0, le=MAX_LR, description="peak learning rate (default optimizer)")
    weight_decay: float = Field(0.01, ge=0, le=MAX_WEIGHT_DECAY, description="AdamW weight decay")
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999],
                               description="AdamW betas, two numbers in [0, 1)")
    warmup_steps: int = Field(20, ge=0, le=MAX_STEP, description="linear warm-up steps")
    min_lr_ratio: float = Field(0.1, ge=0, le=1,
                                description="cosine decay floor, as a fraction of lr")
    grad_clip: float = Field(1.0, ge=0, description="gradient norm clip (0: off)")

    @field_validator("betas")
    @classmethod
    def _two_betas(cls, v: list[float]) -> list[float]:
        if len(v) != 2 or not all(0 <= b < 1 for b in v):
            raise ValueError("must be two numbers in [0, 1)")
        return v


class CheckpointConfig(Section):
    every_steps: int | None = Field(50, ge=1, description="commit every N steps (null: off)")
    every_seconds: float | Literal[AUTO] | None = Field(
        None, description="commit every T seconds (> 0); auto: T = sqrt(2 * stall * MTBF), "
        "from the measured stall of a save and the experiment's failure history (null: off)")
    mtbf_seconds: float = Field(
        6 * 3600.0, gt=0, description="the mean time between failures of your machines, "
        "assumed until the experiment has a failure history (and when run standalone); "
        "given, it turns every_seconds to auto unless every_seconds is given too")
    on_epoch_end: bool = Field(True, description="commit at the end of each epoch")
    on_best: bool = Field(True, description="commit when evaluation gives a new best loss")
    keep_last: int = Field(3, ge=1, description="retention: the last K checkpoints")
    keep_best: bool = Field(True, description="retention: also keep the best one")
    async_save: bool = Field(False, description="snapshot into reused host buffers while "
                             "training goes on, and write on a background thread (needs host "
                             "memory for one copy of the optimizers' tensors)")
    continue_finished: bool = Field(False, description="train past the run's final "
                                    "checkpoint: without it, a run that reached its end is "
                                    "done, and running it again trains nothing")
    # Liveness: the reconciler declares a run dead when its heartbeat is older than
    # CKPT_HEARTBEAT_TIMEOUT_S (120 s), so a heartbeat is not optional. It is written by a
    # thread of its own (trainer.process.liveness), whatever a step costs.
    heartbeat_seconds: float = Field(5.0, description="liveness heartbeat interval, 0 to "
                                     f"{MAX_HEARTBEAT_S:.0f} s, beaten on its own thread "
                                     "whatever a step costs (0: after every step)")
    collective_timeout_s: float = Field(
        600.0, gt=0, le=MAX_COLLECTIVE_S, description="several ranks: the longest the "
        "session waits for the other ranks (each step's agreement, a save's barrier); past "
        "it the attempt fails as rank_lost and is resumed")

    @field_validator("every_seconds", mode="before")
    @classmethod
    def _seconds_or_auto(cls, v: Any) -> Any:
        number = isinstance(v, int | float) and not isinstance(v, bool)
        if v is None or v == AUTO or (number and math.isfinite(v) and v > 0):
            return v
        raise ValueError(f"config key 'checkpoint.every_seconds' must be a number of seconds "
                         f"above 0, {AUTO!r} (the interval sets itself) or null (off); got {v!r}")

    @model_validator(mode="after")
    def _mtbf_sets_the_interval(self) -> CheckpointConfig:
        # Whoever knows how often their machines fail has said all the interval needs: one
        # key, not two (T = sqrt(2 * stall * MTBF), the stall measured).
        if "mtbf_seconds" in self.model_fields_set and "every_seconds" not in self.model_fields_set:
            self.every_seconds = AUTO
        return self

    @field_validator("heartbeat_seconds")
    @classmethod
    def _heartbeat_on(cls, v: float) -> float:
        if not 0 <= v <= MAX_HEARTBEAT_S:
            raise ValueError(f"must be between 0 (every step) and {MAX_HEARTBEAT_S:.0f}: the "
                             "orchestrator declares a run dead when its heartbeat stops, so "
                             "it cannot be turned off")
        return v


class DistributedConfig(Section):
    nproc_per_node: int = Field(1, ge=1, le=MAX_PARALLEL, description="ranks on this node "
                                "(above 1: the attempt runs under torchrun, one process per "
                                "rank, and the global batch is split over the ranks)")
    nnodes: int = Field(1, ge=1, le=MAX_PARALLEL, description="nodes; above 1 with "
                        "rdzv_endpoint, every other node runs the same `python -m "
                        "trainer.ranks` command (docs/ranks.md); without it, the attempt "
                        "starts every node on this machine")
    rdzv_endpoint: str | None = Field(None, description="host:port of the c10d rendezvous: "
                                      "several nodes: node 0's, reachable from every node; "
                                      "one node: a port of this machine (else a free one)")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="task mode's process group: auto is nccl on CUDA, else gloo")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="task mode: ddp replicates the model on every rank; fsdp shards "
        "it (FSDP2 `fully_shard` on each layer that holds parameters, then the model) and "
        "checkpoints model and optimizer through torch.distributed.checkpoint, so a resume "
        "reshards them at any world size")
    heartbeat_timeout_seconds: float = Field(
        30.0, gt=0, le=MAX_COLLECTIVE_S, description="several ranks: the ranks launcher "
        "stops the attempt when a rank is silent this long (frozen, in a debugger)")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None and (problem := rendezvous_problem(v)):
            raise ValueError(problem)
        return v


class ResumeConfig(Section):
    """This run's resume policy; null keys take the deployment's (its CKPT_* variables)."""

    heartbeat_timeout_seconds: float | None = Field(
        None, gt=0, le=MAX_COLLECTIVE_S, description="declared dead after this long without "
        "a heartbeat (deployment default 120)")
    stall_timeout_seconds: float | None = Field(
        None, gt=0, description="declared stalled after this long heartbeating without a "
        "step (deployment default 1800)")
    max_preemptions: int | None = Field(None, ge=0, description="preemptions resumed since "
                                        "the checkpoint last advanced (deployment default 50)")
    max_transient_failures: int | None = Field(
        None, ge=0, description="failures (killed, storage, stalled) resumed in a row without "
        "the checkpoint advancing; one more stops the run as a crash loop (deployment default 3)")
    backoff_base_seconds: float | None = Field(None, ge=0, description="back-off before the "
                                               "first resume without progress, doubling after")
    backoff_max_seconds: float | None = Field(None, ge=0, description="the longest back-off")
    in_run_relaunch: bool | None = Field(None, description="relaunch a dead trainer in its "
                                         "own run when its run worker lives (default on)")


class DataConfig(Section):
    shuffle: bool = Field(True, description="false: the dataset's own order (text in sequence)")
    num_workers: int = Field(0, ge=0, le=MAX_PARALLEL, description="DataLoader worker processes")


class AmpConfig(Section):
    dtype: Literal["bfloat16", "float16"] | None = Field(
        None, description="autocast dtype: bfloat16 (CPU and CUDA) or float16 (with a "
                          "GradScaler); null: full precision")


class TrainConfig(Section):
    run: str = Field("run", description="run name (the partition key under Dagster)")
    experiment: str = Field("default", description="experiment the run belongs to")
    task: str = Field("trainer.tasks.toy:build",
                      description="package.module:function returning a trainer.api.task.Task")
    task_args: dict[str, Any] = Field(default_factory=dict,
                                      description="arguments the task function receives")
    dataset: str | None = Field(None, description="data by reference: a path, "
                                "file:///abs/path or s3://bucket/prefix (null: the task "
                                "generates its own)")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="seeds Python, NumPy and torch")
    max_steps: int = Field(200, ge=1, le=MAX_STEP, description="optimizer steps to train")
    batch_size: int = Field(32, ge=1, description="samples per batch")
    grad_accum_steps: int = Field(1, ge=1, description="batches per optimizer step")
    eval_every: int = Field(50, ge=0, description="evaluate every N steps (0: only at the end)")
    threads: int = Field(1, ge=1, le=MAX_PARALLEL, description="torch CPU threads")
    deterministic: bool = Field(True, description="torch.use_deterministic_algorithms")
    device: str = Field("auto", description="auto (CUDA when present), cpu, cuda or cuda:N")
    amp: AmpConfig = Field(default_factory=AmpConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    resume: ResumeConfig = Field(default_factory=ResumeConfig)
    command: list[str] | None = Field(None, description="command mode: the script to run "
                                      "instead of a task, e.g. [python, train.py]")
    cwd: str | None = Field(None, description="command mode: working directory")
    env: dict[str, str] = Field(default_factory=dict,
                                description="command mode: environment variables added")
    resume_flag: str | None = Field(None, description="command mode: a flag that also hands "
                                    "over the checkpoint to resume from, e.g. --resume-from "
                                    "(null: none; CheckpointSession reads resume_env)")
    resume_env: str | None = Field(Env.RESUME_FROM.value, description="command mode: the "
                                   "variable that hands over the checkpoint to resume from")

    @field_validator("run", "experiment")
    @classmethod
    def _safe_name(cls, v: str, info) -> str:
        return validate_name(v, f"{info.field_name} name")

    @field_validator("env")
    @classmethod
    def _not_the_orchestrators(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if reserved(name):
                raise ValueError(
                    f"config key 'env' sets {name}, which the orchestrator sets for every "
                    f"attempt (names starting {' or '.join(RESERVED_PREFIXES)} are reserved: "
                    "they say which run a process writes); remove it from env")
        return env

    @field_validator("resume_env")
    @classmethod
    def _resume_env_not_the_orchestrators(cls, name: str | None) -> str | None:
        if name and name != Env.RESUME_FROM and reserved(name):
            raise ValueError(f"config key 'resume_env' names {name}, a variable the "
                             f"orchestrator reserves; use {Env.RESUME_FROM.value} or a name "
                             "of your own")
        return name

    @field_validator("task_args", mode="before")
    @classmethod
    def _shallow_args(cls, v: Any) -> Any:
        deepest = depth_of(v)
        if deepest > MAX_TASK_ARGS_DEPTH:
            raise ValueError(f"config key 'task_args' is nested {deepest} levels deep; at most "
                             f"{MAX_TASK_ARGS_DEPTH} are allowed: pass the task flatter "
                             "arguments (or a file path it reads)")
        return v

    @field_validator("task")
    @classmethod
    def _task_spec(cls, v: str) -> str:
        if not TASK_SPEC.fullmatch(v):
            raise ValueError(f"config key 'task' is {v!r}: expected 'package.module:function' "
                             "(dotted Python names, e.g. trainer.tasks.toy:build), not a path")
        return v

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if not DEVICE_SPEC.fullmatch(v):
            raise ValueError(f"config key 'device' is {v!r}: use auto, cpu, cuda or cuda:N")
        return v

    @field_validator("task_args")
    @classmethod
    def _strict_json_args(cls, v: dict[str, Any]) -> dict[str, Any]:
        bad = non_finite_path(v)
        if bad is not None:
            raise ValueError(f"config key 'task_args{bad}' is not a finite number: the config "
                             "is stored as JSON, which has no NaN or infinity; pass a number "
                             "or a string the task parses")
        return v

    @model_validator(mode="after")
    def _one_way_in(self) -> TrainConfig:
        if self.command is not None:
            if not self.command or not all(self.command):
                raise ValueError("config key 'command' must be a non-empty list of arguments, "
                                 "e.g. [python, train.py, --epochs, '3']")
        elif ":" not in self.task:
            raise ValueError(f"config key 'task' is {self.task!r}: expected "
                             "'package.module:function'")
        return self

    @model_validator(mode="after")
    def _fits_the_ranks(self) -> TrainConfig:
        """What the ranks would refuse once started, refused when the config is read."""
        world = self.distributed.world_size
        if world > 1 and self.batch_size % world:
            raise ValueError(f"config key 'batch_size' is {self.batch_size}, which does not "
                             f"split evenly over {world} ranks (distributed.nproc_per_node x "
                             f"nnodes); make it a multiple of {world}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


def depth_of(value: Any) -> int:
    """How deeply lists and mappings nest in `value`, without recursion (a hostile value
    nests deeper than Python's recursion limit)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, depth = todo.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list | tuple) else None
        if items is None:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_TASK_ARGS_DEPTH:
            return deepest  # deep enough to refuse: no need to walk the rest
        todo.extend((item, depth + 1) for item in items)
    return deepest


_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false",
               "string": "a string", "list": "a list", "dict": "a mapping"}


def _message(err: dict[str, Any], model: type[BaseModel], prefix: str) -> str:
    """One line for one pydantic error, naming the key by its dotted path."""
    loc = [str(p) for p in err["loc"]]
    path = ".".join([prefix, *loc] if prefix else loc)
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "extra_forbidden":
        parent = model
        for part in loc[:-1]:
            parent = parent.model_fields[part].annotation
        where = f" in {'.'.join([prefix, *loc[:-1]] if prefix else loc[:-1])!r}" \
            if len(loc) > 1 or prefix else ""
        return (f"unknown config key(s){where}: {loc[-1]}. Allowed: "
                f"{', '.join(sorted(parent.model_fields))}")
    if kind == "finite_number":
        return f"config key {path!r}: expected a finite number, got {err['input']!r}"
    if kind.endswith("_type") and kind[:-5] in _TYPE_WORDS:
        return f"config key {path!r}: expected {_TYPE_WORDS[kind[:-5]]}, got {err['input']!r}"
    if kind == "greater_than":
        rule = "positive" if ctx.get("gt") == 0 else f"greater than {ctx.get('gt')}"
        return f"config key {path!r} must be {rule} (got {err['input']!r})"
    if kind == "greater_than_equal":
        return f"config key {path!r} must be at least {ctx.get('ge')} (got {err['input']!r})"
    if kind == "less_than_equal":
        return f"config key {path!r} must be at most {ctx.get('le')} (got {err['input']!r})"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if msg.startswith("config key"):
        return msg
    return f"config key {path!r}: {msg} (got {err['input']!r})" if loc else msg


def parse(model: type[Section], raw: Any, prefix: str = "") -> Any:
    """`raw` checked against `model`; ConfigError names the first offending key."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config {prefix or 'file'}: expected a mapping, got {raw!r}")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_message(e.errors()[0], model, prefix)) from None


def config_from_dict(raw: dict[str, Any]) -> TrainConfig:
    return parse(TrainConfig, raw)
