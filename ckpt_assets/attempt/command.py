"""What `model_checkpoint` starts for one attempt: the trainer on a task, or a user's command.

Task mode runs `python -m trainer --config FILE --store URI --resume auto`. Command mode
runs the registered `command` in its `cwd` with its `env`, after finding the newest
checkpoint that verifies and passing it as `resume_flag URI` and in $`resume_env` (the
script hands it to `CheckpointSession(resume=...)`). Both get the same environment: the
run, experiment, store, attempt and dataset, so the session inside commits to the same
place whichever way in was taken.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ckpt_assets.base.datasets import DatasetRecord
from ckpt_assets.base.names import REPO_ROOT
from ckpt_assets.base.registration import Registration
from ckpt_assets.lifecycle.failure_history import experiment_mtbf
from trainer.base import strict_json
from trainer.base.interval import AUTO, Mtbf
from trainer.checkpoints.repo import CheckpointRepo
from trainer.process.contract import RANKS_LAUNCHER, RESUME_FROM_ALIAS, LaunchEnv
from trainer.storage import ObjectStore


class TrainerSettings(Protocol):
    """How attempts are started, as `defs.resources.TrainerSettings` configures it (read
    through this, so this layer never imports `defs/`)."""

    @property
    def python(self) -> str: ...
    @property
    def cwd(self) -> str: ...
    @property
    def pythonpath(self) -> list[str]: ...
    @property
    def extra_env(self) -> dict[str, str]: ...
    @property
    def shares_filesystem(self) -> bool: ...
    @property
    def log_level(self) -> str: ...
    @property
    def grace_period_seconds(self) -> float: ...
    @property
    def worker_environ(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class TrainerCommand:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    resume_from: str | None = None  # command mode: the checkpoint handed to the command


@dataclass(frozen=True)
class AttemptIds:
    attempt: int
    dagster_run_id: str
    root_run_id: str
    code_version: str | None


def contract(reg: Registration, store_uri: str, ids: AttemptIds,
             dataset: DatasetRecord, mtbf: Mtbf | None = None) -> LaunchEnv:
    """What this attempt's process is told about the run it trains (`trainer.process.contract`);
    `mtbf`: the experiment's, from `attempt_mtbf`."""
    return LaunchEnv(
        run=reg.run, experiment=reg.experiment, store_uri=store_uri, attempt=ids.attempt,
        dagster_run_id=ids.dagster_run_id, root_run_id=ids.root_run_id,
        code_version=ids.code_version, dataset_uri=dataset.uri or None,
        data_version=dataset.version,
        # Liveness is the orchestrator's concern: its heartbeat interval holds for commands too.
        heartbeat_seconds=reg.config.checkpoint.heartbeat_seconds, mtbf=mtbf)


def attempt_mtbf(context, store: ObjectStore, reg: Registration) -> Mtbf | None:
    """The experiment's MTBF for the attempt `context` runs (its instance, run and log), if
    it may set its interval itself: a task whose config says `every_seconds: auto`, or a
    command (its script passes its own triggers)."""
    ck, log = reg.config.checkpoint, context.log
    if ck.every_seconds != AUTO and not reg.config.command:
        return None
    try:
        mtbf = experiment_mtbf(context.instance, store, reg.experiment, ck.mtbf_seconds,
                               context.run.run_id)
    except Exception as e:  # the history sharpens the interval; the attempt runs without it
        log.warning(f"could not read the failure history of experiment {reg.experiment!r} "
                    f"({e}); the interval uses checkpoint.mtbf_seconds={ck.mtbf_seconds:g}")
        return None
    log.info(f"experiment {reg.experiment!r}: MTBF {mtbf.seconds:.0f}s ({mtbf.source}: "
             f"{mtbf.failures} failures in {mtbf.observed_seconds:.0f}s of training)")
    return mtbf


def base_env(trainer: TrainerSettings, aws_env: dict[str, str]) -> dict[str, str]:
    """The environment an attempt's process starts from: the run worker's as the run began
    (`worker_environ`: the same for every attempt, so a standby fits each) without the
    contract's variables (a stale one must never reach the trainer), plus the store's
    credentials as they are now."""
    env = {**LaunchEnv.scrubbed(trainer.worker_environ), **aws_env, **trainer.extra_env,
           "PYTHONUNBUFFERED": "1"}
    # The user's modules first (TrainerSettings.pythonpath), then ckpt-assets itself, so
    # both the trainer and a task module outside this repository import.
    paths = [*trainer.pythonpath, str(REPO_ROOT), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def _own_process(reg: Registration, env: dict[str, str], trainer: TrainerSettings) -> TrainerCommand:
    """The process every attempt of `reg` starts (one rank's), less what each attempt adds."""
    cfg = reg.config
    if not cfg.command:
        return TrainerCommand([trainer.python, "-m", "trainer"], env, trainer.cwd)
    argv = list(cfg.command)
    if argv[0] == "python":  # the orchestrator's interpreter, not whatever PATH has first
        argv[0] = trainer.python
    # The user's variables, then the contract's last: a config cannot override them (they
    # are refused at registration too; this holds for a registration written by hand).
    env = {**env, **cfg.env}
    env.pop(RESUME_FROM_ALIAS, None)  # only what this attempt found counts
    return TrainerCommand(argv, env, str(Path(trainer.cwd, cfg.cwd or ".")))


def standing_launch(reg: Registration, env: dict[str, str], trainer: TrainerSettings) -> TrainerCommand:
    """What every attempt of `reg` launches, less what each adds (its contract, its config
    file, the checkpoint it resumes): enough to start the standby it can become
    (`ckpt_assets.attempt.warm_start`) before the attempt is known."""
    own = _own_process(reg, env, trainer)
    return dataclasses.replace(own, argv=under_ranks(reg, trainer, own.argv))


def task_launch(reg: Registration, launch: LaunchEnv, env: dict[str, str],
                trainer: TrainerSettings, workdir: Path) -> TrainerCommand:
    config_path = reg.config_uri  # a trainer elsewhere reads the registered config itself
    if trainer.shares_filesystem:
        config_path = str(workdir / "config.json")
        Path(config_path).write_text(strict_json.dumps(reg.config.to_dict(), indent=1))
    own = _own_process(reg, env, trainer)
    argv = [*own.argv, "--config", config_path, "--store", launch.store_uri,
            "--resume", "auto", "--log-level", trainer.log_level]
    return TrainerCommand(under_ranks(reg, trainer, argv), {**own.env, **launch.to_env()}, own.cwd)


def under_ranks(reg: Registration, trainer: TrainerSettings, argv: list[str]) -> list[str]:
    """`argv` once per rank through `python -m RANKS_LAUNCHER` (torchrun, its restarts off,
    one exit status for the attempt) when the config asks for several ranks, or the launch
    names a world size for a command (a torchrun script needs its RANK, LOCAL_RANK and
    WORLD_SIZE on one rank as on several); else `argv`."""
    d = reg.config.distributed
    if d.world_size == 1 and not (reg.config.command and reg.world_asked):
        return argv
    wrapper = [trainer.python, "-m", RANKS_LAUNCHER, "--nproc-per-node",
               str(d.nproc_per_node), "--nnodes", str(d.nnodes),
               # Every rank gets the grace to commit before torchrun kills it.
               "--grace-seconds", str(math.ceil(trainer.grace_period_seconds)),
               "--heartbeat-timeout-s", f"{d.heartbeat_timeout_seconds:g}"]
    if d.rdzv_endpoint:  # several nodes meet there; one node rendezvouses there alone
        wrapper += ["--rdzv-endpoint", d.rdzv_endpoint, "--rdzv-id", reg.run]
    elif d.nnodes > 1:  # nowhere else to meet: every node on this machine
        wrapper += ["--local-nodes", "--rdzv-id", reg.run]
    return [*wrapper, "--", *argv]


def command_launch(reg: Registration, repo: CheckpointRepo, launch: LaunchEnv,
                   env: dict[str, str], trainer: TrainerSettings, log) -> TrainerCommand:
    cfg = reg.config
    manifest, skipped = repo.find_latest_valid()
    for name, reason in skipped:
        log.warning(f"CHECKPOINT FALLBACK: {repo.uri(name)} skipped: {reason}")
    resume = repo.uri(manifest.name) if manifest else None
    own = _own_process(reg, env, trainer)
    argv, env = list(own.argv), dict(own.env)
    if resume and cfg.resume_flag:
        argv += [cfg.resume_flag, resume]
    if resume and cfg.resume_env:
        env[cfg.resume_env] = resume
    env.update(dataclasses.replace(launch, resume_from=resume).to_env())
    return TrainerCommand(under_ranks(reg, trainer, argv), env, own.cwd, resume)
