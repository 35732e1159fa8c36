"""The registration of a training run (one partition key of `training_runs` per run; the
key is the run name of the trainer config).

Registering a run records its training config ONCE, in the checkpoint store:

    <store>/<experiment>/<run>/config.json    the normalized training config (create-once)
    <store>/REGISTRY/<run>.json               run -> experiment, config SHA-256 (create-once)

and then adds the dynamic partition. Every attempt of the run reads the registered config,
so a resumed attempt can never train with a different config than the first one.

Order matters: everything that can be refused (the name, the config, the store) is checked
before anything is written, so bad input leaves no half-registered run behind. The two
writes are create-once; a registration cut off between them is completed by registering
again with the same config, and a different config is refused with a clear message.

`REGISTRY` is upper case on purpose: experiment names are lower case
(`trainer.storage.NAME_RULE`), so the index can never collide with an experiment.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_assets.base.names import PARTITIONS_NAME
from trainer.base import strict_json
from trainer.base.errors import AlreadyExistsError, ConfigError
from trainer.config import TrainConfig, config_from_dict
from trainer.storage import NAME_RULE, ObjectStore, validate_name

if TYPE_CHECKING:
    from dagster import DagsterInstance

REGISTRY_PREFIX = "REGISTRY"
CONFIG_FILE = "config.json"


__all__ = [
    "NAME_RULE",
    "Registration",
    "RegistrationConflict",
    "add_partition",
    "canonical_json",
    "config_key",
    "normalize_training_config",
    "read_registration",
    "register_training_run",
    "registry_key",
    "validate_partition_key",
]


class RegistrationConflict(ConfigError):
    """The run is registered already, with another config or in another experiment."""


def validate_partition_key(key: str) -> str:
    """A partition key becomes a path segment in the store: same rule as run names."""
    return validate_name(key, "training run name (partition key)")


def canonical_json(obj: Any) -> bytes:
    return strict_json.dumps(obj, indent=1, sort_keys=True).encode()


def registry_key(run: str) -> str:
    return f"{REGISTRY_PREFIX}/{validate_partition_key(run)}.json"


def config_key(experiment: str, run: str) -> str:
    return f"{validate_name(experiment, 'experiment name')}/{validate_partition_key(run)}/{CONFIG_FILE}"


def normalize_training_config(raw: dict[str, Any] | None, run: str,
                              experiment: str | None = None,
                              base_dir: Path | None = None) -> TrainConfig:
    """Validate `raw` exactly as the trainer would and return the full typed config.

    The run name is forced to the partition key; `experiment` (if given) overrides the
    config's. Raises ConfigError (bad input) with the trainer's own message.
    """
    validate_partition_key(run)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"training config must be a mapping, got {type(raw).__name__}")
    raw = dict(raw)
    if raw.get("run") not in (None, run):
        raise ConfigError(
            f"the training config names run {raw['run']!r} but the training run (partition "
            f"key) is {run!r}; drop 'run' from the config or make them match"
        )
    raw["run"] = run
    if experiment:
        if raw.get("experiment") not in (None, experiment):
            raise ConfigError(
                f"the training config names experiment {raw['experiment']!r} but "
                f"--experiment/experiment is {experiment!r}; make them match"
            )
        raw["experiment"] = experiment
    cfg = config_from_dict(raw)
    if cfg.command is None:
        _check_task(cfg.task)
    elif base_dir is not None:
        # Registered from a config file (the CLI): where the command runs is known here, so
        # everything the launch would trip on is refused now, before the name is taken. A
        # config given in a Dagster launch is checked by the launch (exit 2, never resumed).
        cfg = anchor_command(cfg, base_dir)
        check_command(cfg, base_dir)
    return cfg


def anchor_command(cfg: TrainConfig, base_dir: Path) -> TrainConfig:
    """A command's `cwd` made absolute against `base_dir` (the `ckpt-assets` CLI passes the
    directory it runs in); no `cwd` is `base_dir` itself. (A config given in a Dagster
    launch keeps a relative `cwd` relative to the TrainerResource's working_directory.)"""
    if cfg.cwd and os.path.isabs(cfg.cwd):
        return cfg
    cwd = Path(base_dir, cfg.cwd or ".").resolve()
    return cfg.model_copy(update={"cwd": str(cwd)})


def check_command(cfg: TrainConfig, base_dir: Path | None = None) -> None:
    """Refuse what the launch could not start, as the launch resolves it
    (`ckpt_assets.attempt.command.command_launch`): `cwd` must be a directory; `python` is the
    orchestrator's interpreter and the script it is given must exist in `cwd`; a path with a
    slash is relative to `cwd` and must be an executable file; a bare name must be on PATH
    (the config's `env` PATH if it sets one). A relative `cwd` without `base_dir` is
    unknown here: only what does not depend on it is checked."""
    assert cfg.command
    where = f" (relative paths are relative to {base_dir}, where it was registered from)" \
        if base_dir is not None else ""
    cwd = Path(cfg.cwd) if cfg.cwd and os.path.isabs(cfg.cwd) else None
    if cwd is not None and not cwd.is_dir():
        raise ConfigError(f"config key 'cwd': {cwd} is not a directory{where}; fix cwd")
    program, args = cfg.command[0], cfg.command[1:]
    if Path(program).name.startswith("python"):  # an interpreter: check its script too
        script = args[0] if args and not args[0].startswith("-") else None
        if script and cwd is not None and not Path(cwd, script).is_file():
            raise ConfigError(f"config key 'command' runs the script {script!r}, but "
                              f"{Path(cwd, script)} does not exist{where}; fix the command "
                              "or cwd")
        if program == "python":
            return  # the orchestrator's own interpreter
    if os.sep in program:
        if cwd is None and not os.path.isabs(program):
            return
        path = Path(cwd or "/", program)
        if not path.is_file():
            raise ConfigError(f"config key 'command': {path} does not exist{where}; fix the "
                              "command or cwd")
        if not os.access(path, os.X_OK):
            raise ConfigError(f"config key 'command': {path} is not executable; chmod +x it, "
                              f"or run it as [python, {program}]")
    elif shutil.which(program, path=cfg.env.get("PATH", os.environ.get("PATH"))) is None:
        raise ConfigError(f"config key 'command': {program!r} is not on PATH; give its path, "
                          "or use python for the orchestrator's interpreter")


def _check_task(spec: str) -> None:
    """Refuse a task the trainer could not import (its arguments are the task's to check).
    A module whose source defines the function at its top level passes unimported: a task
    module imports torch, seconds of every `ckpt-assets launch`. Anything else is imported
    as the trainer will import it, which says what is wrong."""
    if _defines_function(spec):
        return
    from trainer.api.task import resolve_task

    resolve_task(spec)


def _defines_function(spec: str) -> bool:
    module_name, _, func_name = spec.partition(":")
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):  # a parent package is missing, or the name is empty
        return False
    origin = found.origin if found is not None else None
    if not func_name or not origin or not origin.endswith(".py"):
        return False
    try:
        tree = ast.parse(Path(origin).read_bytes(), origin)
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(node, ast.FunctionDef) and node.name == func_name
               for node in tree.body)


@dataclass(frozen=True)
class Registration:
    """A registered training run: its typed config, and where the exact bytes lie that its
    SHA-256 names (the bytes are the record; the typed config is read from them)."""

    run: str
    experiment: str
    config: TrainConfig
    config_uri: str
    config_sha256: str
    created: bool = field(default=False, compare=False)  # True if this call wrote it
    # What a correction changed (a run without a committed checkpoint registered again).
    corrected: str | None = field(default=None, compare=False)
    # A launch of this run named its world size (`runs.world.at_world`): a command then
    # runs under the ranks launcher whatever the size, one rank included.
    world_asked: bool = field(default=False, compare=False)

    @classmethod
    def from_bytes(cls, run: str, body: bytes, uri: str, created: bool = False) -> Registration:
        try:
            config = config_from_dict(json.loads(body))
        except (ValueError, ConfigError) as e:
            raise ConfigError(f"the registered config {uri} no longer reads as a training "
                              f"config ({e}); register a new run name") from None
        return cls(run, config.experiment, config, uri, hashlib.sha256(body).hexdigest(),
                   created)


def _read_json(store: ObjectStore, key: str) -> dict[str, Any] | None:
    try:
        data = store.read_bytes(key)
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise ConfigError(f"{store.uri_for(key)} is not valid JSON ({e}); it is corrupt") from e
    if not isinstance(obj, dict):
        raise ConfigError(f"{store.uri_for(key)} does not hold a JSON object; it is corrupt")
    return obj


def read_registration(store: ObjectStore, run: str) -> Registration | None:
    """The registered config of `run`, verified against its registry entry; None if unregistered."""
    entry = _read_json(store, registry_key(run))
    if entry is None:
        return None
    experiment = entry.get("experiment")
    key = config_key(experiment, run)
    try:
        data = store.read_bytes(key)
    except FileNotFoundError:
        raise ConfigError(
            f"training run {run!r} is registered in experiment {experiment!r} but "
            f"{store.uri_for(key)} is missing; the store was modified by hand"
        ) from None
    sha = hashlib.sha256(data).hexdigest()
    if sha != entry.get("config_sha256"):
        raise ConfigError(
            f"{store.uri_for(key)} has SHA-256 {sha} but the registry entry "
            f"{store.uri_for(registry_key(run))} says {entry.get('config_sha256')}; the "
            "registered config is corrupt"
        )
    return Registration.from_bytes(run, data, store.uri_for(key))


def register_training_run(store: ObjectStore, run: str, raw_config: dict[str, Any] | None,
                          experiment: str | None = None,
                          instance: DagsterInstance | None = None,
                          base_dir: Path | None = None,
                          may_correct: bool = False) -> Registration:
    """Record `raw_config` as the config of training run `run` (create-once), then add the
    partition to `instance` (if given).

    Re-registering with the same (normalized) config is a no-op. A different config, or
    another experiment, raises RegistrationConflict, unless `may_correct` and the run has no
    committed checkpoint and no active Dagster run (nothing the new config could
    contradict): then the config is replaced and `Registration.corrected` says what changed.
    `base_dir` anchors a command's relative paths (`anchor_command`). Nothing is written on
    bad input.
    """
    config = normalize_training_config(raw_config, run, experiment, base_dir)
    store.check_reachable()  # StorageError before anything is written

    existing = read_registration(store, run)
    if existing is not None and existing.config == config:
        if instance is not None:
            add_partition(instance, run)
        return existing
    if existing is not None:
        _check_correctable(store, existing, config, instance, may_correct)
    reg = _write_registration(store, run, config, overwrite=existing is not None)
    if existing is not None:
        reg = replace(reg, corrected=_diff(existing.config.to_dict(), config.to_dict()))
        if existing.experiment != config.experiment:
            store.delete(config_key(existing.experiment, run))
    if instance is not None:
        add_partition(instance, run)
    return reg


def _check_correctable(store: ObjectStore, existing: Registration, config: TrainConfig,
                       instance: DagsterInstance | None, may_correct: bool) -> None:
    """Refuse to replace a registered config that anything already depends on."""
    from trainer.checkpoints.repo import CheckpointRepo

    if not may_correct or CheckpointRepo(store, existing.experiment, existing.run).committed():
        _compare(existing, config)
    if instance is not None:
        from ckpt_assets.base.queries import active_runs

        active = active_runs(instance, existing.run)
        if active:
            raise RegistrationConflict(
                f"training run {existing.run!r} has no committed checkpoint, but Dagster run "
                f"{active[0].run_id} ({active[0].status.value}) is training it with the "
                f"registered config; stop it first (python -m ckpt_assets stop "
                f"{existing.run}), then register the corrected config")


def _write_registration(store: ObjectStore, run: str, config: TrainConfig,
                        overwrite: bool) -> Registration:
    """config.json, then the registry entry naming its SHA-256 (create-once unless
    `overwrite`, which only a correctable registration asks for)."""
    body = canonical_json(config.to_dict())
    sha = hashlib.sha256(body).hexdigest()
    ckey = config_key(config.experiment, run)
    if overwrite:
        store.write_overwrite(ckey, body)
    else:
        try:
            store.put_new(ckey, body)
        except AlreadyExistsError:
            # A registration cut off after config.json: the same config completes it.
            old = store.read_bytes(ckey)
            if old != body:
                _compare(Registration.from_bytes(run, old, store.uri_for(ckey)), config)
    entry = {"run": run, "experiment": config.experiment, "config_key": ckey,
             "config_sha256": sha, "registered_at": time.time()}
    if overwrite:
        store.write_overwrite(registry_key(run), canonical_json(entry))
        return Registration.from_bytes(run, body, store.uri_for(ckey), created=True)
    try:
        store.put_new(registry_key(run), canonical_json(entry))
    except AlreadyExistsError:
        # Another registration won the race: it is the one that counts.
        winner = read_registration(store, run)
        assert winner is not None
        _compare(winner, config)
        return winner
    return Registration.from_bytes(run, body, store.uri_for(ckey), created=True)


def _compare(existing: Registration, config: TrainConfig) -> None:
    if existing.experiment != config.experiment:
        raise RegistrationConflict(
            f"training run {existing.run!r} is already registered in experiment "
            f"{existing.experiment!r}, not {config.experiment!r}; partition keys are unique "
            "across experiments, so pick another run name"
        )
    if existing.config != config:
        diff = _diff(existing.config.to_dict(), config.to_dict())
        raise RegistrationConflict(
            f"training run {existing.run!r} is already registered with a different config "
            f"({existing.config_uri}); differences: {diff}. A run's config never changes: "
            "register a new run name for a new config, or launch without a config"
        )


def _diff(a: Any, b: Any, path: str = "") -> str:
    out: list[str] = []

    def walk(x: Any, y: Any, p: str) -> None:
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                walk(x.get(k), y.get(k), f"{p}.{k}" if p else k)
        elif x != y:
            out.append(f"{p}: registered {x!r}, given {y!r}")

    walk(a, b, path)
    return "; ".join(out[:5]) + (f"; and {len(out) - 5} more" if len(out) > 5 else "")


def add_partition(instance: DagsterInstance, run: str) -> None:
    from sqlalchemy.exc import IntegrityError

    validate_partition_key(run)
    if instance.has_dynamic_partition(PARTITIONS_NAME, run):
        return
    try:
        instance.add_dynamic_partitions(PARTITIONS_NAME, [run])
    except IntegrityError:
        # A concurrent registration added it in between (the key is a unique index).
        if not instance.has_dynamic_partition(PARTITIONS_NAME, run):
            raise
