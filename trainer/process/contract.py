"""The contract between the orchestrator and the trainer it launches, defined once.

Both sides import this module (it needs neither dagster nor torch):

* `Env`: every environment variable of the contract. `LaunchEnv` is what the orchestrator
  tells a process it launched (`to_env()` on its side, `from_env()` in the session). These
  names are reserved: a run's config cannot set them (`reserved`), and the orchestrator
  applies its own values last.
* The Pipes messages the trainer sends, each a typed record (`Started`, `Eval`, `Progress`,
  `Stopped`, `Finished`, `Failed`, and `trainer.checkpoints.records.CheckpointRecord` for `checkpoint`),
  turned into the wire dict by `to_message` and back by `parse_message`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from ..base.errors import ConfigError
from ..base.interval import Mtbf
from ..checkpoints.records import CheckpointRecord, from_known_fields


class Env(StrEnum):
    """Environment variables of the contract (the orchestrator writes them)."""

    RUN = "CKPT_RUN"
    EXPERIMENT = "CKPT_EXPERIMENT"
    STORE_URI = "CKPT_STORE_URI"  # also read standalone: the default store
    ATTEMPT = "CKPT_ATTEMPT"
    DAGSTER_RUN_ID = "CKPT_DAGSTER_RUN_ID"
    ROOT_RUN_ID = "CKPT_ROOT_RUN_ID"
    CODE_VERSION = "CKPT_CODE_VERSION"
    HEARTBEAT_SECONDS = "CKPT_HEARTBEAT_SECONDS"
    DATASET_URI = "CKPT_DATASET_URI"
    DATA_VERSION = "CKPT_DATA_VERSION"
    RESUME_FROM = "CKPT_RESUME_FROM"  # also read standalone: the checkpoint to resume from
    EXIT_WITH_PARENT = "CKPT_EXIT_WITH_PARENT"
    MTBF = "CKPT_MTBF"  # the experiment's mean time between failures (JSON of `Mtbf`)
    # Written by `python -m trainer.ranks` for its ranks: where each beats (trainer.ranks.rank_watch).
    RANK_BEATS = "CKPT_RANK_BEATS"


CONTRACT_NAMES = frozenset(e.value for e in Env)
# What the orchestrator runs an attempt's ranks under (`python -m RANKS_LAUNCHER`): the
# launcher as `ckpt_trainer` (trainer/ranks/launch.py under a name no project shadows), since it
# starts in the run's working directory, which `python -m` puts first on sys.path, and a
# project there may have a `trainer.py` of its own.
RANKS_LAUNCHER = "ckpt_trainer.ranks"
# The seed's name for the resume point, still accepted standalone (never written by us).
RESUME_FROM_ALIAS = "CHECKPOINT_PATH"
# Namespaces the orchestrator owns: Pipes' own bootstrap variables, and ours.
RESERVED_PREFIXES = ("CKPT_", "DAGSTER_PIPES_")


def reserved(name: str) -> bool:
    """Is `name` the orchestrator's to set (so a run's config may not)?"""
    return name.startswith(RESERVED_PREFIXES)


@dataclass(frozen=True)
class LaunchEnv:
    """What the orchestrator tells a trainer it launched, as environment variables."""

    run: str
    experiment: str
    store_uri: str
    attempt: int
    dagster_run_id: str | None = None
    root_run_id: str | None = None
    code_version: str | None = None
    heartbeat_seconds: float | None = None
    dataset_uri: str | None = None
    data_version: str | None = None
    resume_from: str | None = None
    exit_with_parent: bool = True
    mtbf: Mtbf | None = None  # for `checkpoint.every_seconds: auto`

    _NAMES: ClassVar[dict[str, Env]] = {
        "run": Env.RUN, "experiment": Env.EXPERIMENT, "store_uri": Env.STORE_URI,
        "attempt": Env.ATTEMPT, "dagster_run_id": Env.DAGSTER_RUN_ID,
        "root_run_id": Env.ROOT_RUN_ID, "code_version": Env.CODE_VERSION,
        "heartbeat_seconds": Env.HEARTBEAT_SECONDS, "dataset_uri": Env.DATASET_URI,
        "data_version": Env.DATA_VERSION, "resume_from": Env.RESUME_FROM,
        "exit_with_parent": Env.EXIT_WITH_PARENT, "mtbf": Env.MTBF}

    def to_env(self) -> dict[str, str]:
        out = {}
        for name, var in self._NAMES.items():
            value = getattr(self, name)
            if isinstance(value, bool):
                value = "1" if value else None
            elif isinstance(value, Mtbf):
                value = value.to_json()
            if value is not None:
                out[var.value] = str(value)
        return out

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
        """The launch this process is part of; None when the orchestrator did not start it."""
        env = os.environ if environ is None else environ
        if not env.get(Env.RUN):
            return None
        raw = {name: env.get(var) or None for name, var in cls._NAMES.items()}
        return cls(**{**raw, "experiment": raw["experiment"] or "default",
                      "store_uri": raw["store_uri"] or "",
                      "attempt": int(raw["attempt"] or 1),
                      "heartbeat_seconds": float(raw["heartbeat_seconds"])
                      if raw["heartbeat_seconds"] else None,
                      "exit_with_parent": raw["exit_with_parent"] == "1",
                      "mtbf": _mtbf(raw["mtbf"])})

    @staticmethod
    def scrubbed(environ: Mapping[str, str]) -> dict[str, str]:
        """`environ` without any variable of the contract: only this launch's values count."""
        return {k: v for k, v in environ.items()
                if k not in CONTRACT_NAMES and k != RESUME_FROM_ALIAS}


def _mtbf(text: str | None) -> Mtbf | None:
    if not text:
        return None
    try:
        return Mtbf.from_json(text)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{Env.MTBF.value}={text!r} is not the orchestrator's MTBF record "
                          f"({e}); the orchestrator and the trainer are of different "
                          "versions: launch with matching ones") from None


# -- Pipes messages ------------------------------------------------------------------------

@dataclass(frozen=True)
class Skipped:
    checkpoint: str
    reason: str


@dataclass(frozen=True)
class Started:
    TYPE: ClassVar[str] = "started"
    attempt: int
    resumed_from_step: int | None = None
    resumed_from: str | None = None
    skipped: list[Skipped] = field(default_factory=list)
    max_steps: int | None = None
    lineage: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Started:
        skipped = [from_known_fields(Skipped, s) for s in raw.get("skipped") or []]
        return from_known_fields(cls, {**raw, "skipped": skipped})


@dataclass(frozen=True)
class Eval:
    TYPE: ClassVar[str] = "eval"
    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Progress:
    TYPE: ClassVar[str] = "progress"
    step: int
    loss: float | None = None


@dataclass(frozen=True)
class Stopped:
    TYPE: ClassVar[str] = "stopped"
    step: int
    signal: str | None = None


@dataclass(frozen=True)
class Finished:
    TYPE: ClassVar[str] = "finished"
    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Failed:
    TYPE: ClassVar[str] = "failed"
    exit_code: int
    failure_class: str  # a `trainer.base.outcomes.Outcome` value
    error_type: str | None = None
    message: str | None = None
    traceback: str | None = None  # only for an error nobody foresaw (a bug)


CHECKPOINT_MESSAGE = "checkpoint"
Message = Started | Eval | Progress | Stopped | Finished | Failed | CheckpointRecord
MESSAGE_TYPES: dict[str, type] = {
    cls.TYPE: cls for cls in (Started, Eval, Progress, Stopped, Finished, Failed)}


def to_message(record: Message) -> dict[str, Any]:
    """The wire form of a message: its fields and its `type`."""
    kind = CHECKPOINT_MESSAGE if isinstance(record, CheckpointRecord) else record.TYPE
    body = record.to_dict() if isinstance(record, CheckpointRecord) else dataclasses.asdict(record)
    return {"type": kind, **body}


def parse_message(raw: Any) -> Message | None:
    """The record a wire message carries; None for anything that is not one of ours."""
    if not isinstance(raw, dict):
        return None
    kind = raw.get("type")
    if kind == CHECKPOINT_MESSAGE:
        return CheckpointRecord.from_dict(raw)
    cls = MESSAGE_TYPES.get(kind)
    if cls is None:
        return None
    if hasattr(cls, "from_dict"):
        return cls.from_dict(raw)
    return from_known_fields(cls, raw)


# -- how Pipes reaches the trainer ---------------------------------------------------------

class PipesTransport(StrEnum):
    """Where the Pipes context and messages travel: files on a shared machine, or S3 (a
    trainer that shares no filesystem with the orchestrator)."""

    LOCAL = "local"
    S3 = "s3"


# The key the orchestrator adds to the Pipes context and message params it injects; its
# value (`PipesS3Params`) tells the trainer which loader and writer to open.
PIPES_TRANSPORT_PARAM = "ckpt_transport"


@dataclass(frozen=True)
class PipesS3Params:
    """What the trainer needs, beyond Pipes' own bucket and key, to use S3 for Pipes."""

    transport: PipesTransport = PipesTransport.S3
    interval_seconds: float = 1.0  # how often the trainer uploads a chunk of messages

    def to_param(self) -> dict[str, Any]:
        return {PIPES_TRANSPORT_PARAM: {"transport": self.transport.value,
                                        "interval_seconds": self.interval_seconds}}

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> PipesS3Params | None:
        """The S3 transport the params name; None for Pipes' defaults (local files)."""
        raw = params.get(PIPES_TRANSPORT_PARAM)
        if not isinstance(raw, dict) or raw.get("transport") != PipesTransport.S3.value:
            return None
        return cls(PipesTransport.S3, float(raw.get("interval_seconds") or 1.0))
