"""What `model_checkpoint` starts for one attempt: the trainer on a task, or a user's command.

Task mode runs `python -m trainer --config FILE --store URI --resume auto`. Command mode
runs the registered `command` in its `cwd` with its `env`, after finding the newest
checkpoint that verifies and passing it as `resume_flag URI` and in $`resume_env` (the
script hands it to `CheckpointSession(resume=...)`). Both get the same environment: the
run, experiment, store, attempt and dataset, so the session inside commits to the same
place whichever way in was taken.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ckpt_assets.datasets import DatasetRecord
from ckpt_assets.partitions import Registration
from ckpt_assets.resources import REPO_ROOT, TrainerResource
from trainer import strict_json
from trainer.repo import CheckpointRepo


@dataclass(frozen=True)
class Launch:
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


def base_env(reg: Registration, store_uri: str, ids: AttemptIds, dataset: DatasetRecord,
             trainer: TrainerResource, aws_env: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **aws_env, **trainer.extra_env, **dataset.trainer_env,
           "CKPT_RUN": reg.run, "CKPT_EXPERIMENT": reg.experiment, "CKPT_STORE_URI": store_uri,
           "CKPT_ATTEMPT": str(ids.attempt), "CKPT_DAGSTER_RUN_ID": ids.dagster_run_id,
           "CKPT_ROOT_RUN_ID": ids.root_run_id, "CKPT_EXIT_WITH_PARENT": "1",
           "PYTHONUNBUFFERED": "1"}
    if ids.code_version:
        env["CKPT_CODE_VERSION"] = ids.code_version
    # Liveness is the orchestrator's concern: its heartbeat interval holds for commands too.
    env["CKPT_HEARTBEAT_SECONDS"] = str(reg.config["checkpoint"]["heartbeat_seconds"])
    # The user's modules first (TrainerResource.pythonpath), then ckpt-assets itself, so
    # both the trainer and a task module outside this repository import.
    paths = [*trainer.pythonpath, str(REPO_ROOT), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def task_launch(reg: Registration, store_uri: str, env: dict[str, str],
                trainer: TrainerResource, workdir: Path) -> Launch:
    config_path = workdir / "config.json"
    config_path.write_text(strict_json.dumps(reg.config, indent=1))
    argv = [trainer.python, "-m", "trainer", "--config", str(config_path), "--store", store_uri,
            "--resume", "auto", "--log-level", trainer.log_level]
    return Launch(argv, env, trainer.cwd)


def command_launch(reg: Registration, repo: CheckpointRepo, env: dict[str, str],
                   trainer: TrainerResource, log) -> Launch:
    cfg = reg.config
    manifest, skipped = repo.find_latest_valid()
    for name, reason in skipped:
        log.warning(f"CHECKPOINT FALLBACK: {repo.uri(name)} skipped: {reason}")
    resume = repo.uri(manifest.name) if manifest else None
    argv = list(cfg["command"])
    if argv[0] == "python":  # the orchestrator's interpreter, not whatever PATH has first
        argv[0] = trainer.python
    env = {**env, **(cfg.get("env") or {})}
    for inherited in ("CKPT_RESUME_FROM", "CHECKPOINT_PATH"):
        env.pop(inherited, None)  # only what this attempt found counts
    if resume:
        if cfg.get("resume_flag"):
            argv += [cfg["resume_flag"], resume]
        if cfg.get("resume_env"):
            env[cfg["resume_env"]] = resume
        env["CKPT_RESUME_FROM"] = resume
    cwd = cfg.get("cwd") or "."
    return Launch(argv, env, str(Path(trainer.cwd, cwd)), resume)
