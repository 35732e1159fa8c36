"""The training loop and its resume path.

Resume in one sitting: build the task and every stateful part exactly as a fresh run
would, find the checkpoint (newest valid, or the one asked for), claim the run so older
attempts can no longer advance it, load every part, and continue from the next step.
"""

from __future__ import annotations

import logging
import math
import os
import random
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from trainer.checkpointer import Checkpointer, JSONValues, RNGState
from trainer.config import TrainConfig
from trainer.data import ResumableSampler
from trainer.errors import ConfigError, DivergedError
from trainer.progress import Progress
from trainer.repo import CheckpointRepo, Manifest
from trainer.report import Reporter
from trainer.signals import StopRequest
from trainer.storage import open_store, split_uri
from trainer.task import build_task

log = logging.getLogger("trainer")


@dataclass
class LoopState:
    """Counters and history of the loop itself: part of every checkpoint."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    best_score: float = math.inf
    metrics: dict[str, float] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "losses": torch.tensor(self.losses, dtype=torch.float64),
                "best_score": self.best_score, "metrics": dict(self.metrics)}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.step = int(s["step"])
        self.losses = s["losses"].tolist()
        self.best_score = float(s["best_score"])
        self.metrics = dict(s["metrics"])


def lr_schedule(cfg: TrainConfig):
    warm, total, floor = cfg.optim.warmup_steps, cfg.max_steps, cfg.optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total - warm)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


def code_version() -> str | None:
    if os.environ.get("CKPT_CODE_VERSION"):
        return os.environ["CKPT_CODE_VERSION"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def resolve_resume(repo: CheckpointRepo, resume: str) -> tuple[Manifest | None, list]:
    """The checkpoint to resume from: 'auto', 'never', or an explicit checkpoint URI."""
    if resume == "never":
        return None, []
    if resume == "auto":
        return repo.find_latest_valid()
    store_uri, key = split_uri(resume)
    name = key.rsplit("/", 1)[1]
    if f"{repo.experiment}/{repo.run}" != key.rsplit("/", 2)[0].removesuffix("/checkpoints"):
        raise ConfigError(
            f"--resume {resume!r} belongs to another experiment/run than this config's "
            f"{repo.experiment}/{repo.run}; set the config's experiment and run to match"
        )
    if open_store(store_uri).uri != repo.store.uri:
        raise ConfigError(f"--resume {resume!r} is not in the store {repo.store.uri}; "
                          "pass --store with the store that holds it")
    return repo.verify(name), []


def train(cfg: TrainConfig, store_uri: str, resume: str = "auto",
          reporter: Reporter | None = None, stop: StopRequest | None = None) -> int:
    """Run (or continue) training; return the exit code. Errors propagate as TrainerError."""
    reporter = reporter or Reporter()
    stop = stop or StopRequest()
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(cfg.deterministic)
    # Every generator a task might draw from starts from the seed, so that a fresh run is
    # reproducible and a resumed one can be compared with it.
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    store = open_store(store_uri)
    store.check_reachable()
    repo = CheckpointRepo(store, cfg.experiment, cfg.run)

    task = build_task(cfg.task, cfg.task_args, cfg.seed)
    model = task.model
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr,
                                  betas=tuple(cfg.optim.betas),
                                  weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(cfg))
    try:
        sampler = ResumableSampler(len(task.train_data), cfg.batch_size, cfg.seed)
    except ValueError as e:
        raise ConfigError(f"config key 'batch_size': {e}") from None
    loop = LoopState()
    parts: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                             "sampler": sampler, "rng": RNGState(), "loop": loop,
                             "task_values": JSONValues(task.values), **task.stateful}

    attempt = int(os.environ.get("CKPT_ATTEMPT") or repo.next_attempt())
    manifest, skipped = resolve_resume(repo, resume)
    repo.claim(attempt, manifest.name if manifest else None)
    ck = Checkpointer(repo, parts, attempt, cfg.checkpoint.keep_last,
                      cfg.checkpoint.keep_best, cfg.checkpoint.async_save)
    resumed_from = None
    if manifest is not None:
        t0 = time.perf_counter()
        ck.load(manifest)
        resumed_from = manifest.step
        ck.last_saved_step = manifest.step
        reporter.log(f"resumed from {repo.uri(manifest.name)} at step {manifest.step} "
                     f"(restore {time.perf_counter() - t0:.2f}s)")
    else:
        reporter.log(f"starting {cfg.experiment}/{cfg.run} from scratch (attempt {attempt})")
    reporter.event("started", attempt=attempt, resumed_from_step=resumed_from,
                   resumed_from=repo.uri(manifest.name) if manifest else None,
                   skipped=[{"checkpoint": n, "reason": r} for n, r in skipped],
                   max_steps=cfg.max_steps)

    lineage = {"experiment": cfg.experiment, "run": cfg.run, "attempt": attempt,
               "dagster_run_id": os.environ.get("CKPT_DAGSTER_RUN_ID"),
               "root_run_id": os.environ.get("CKPT_ROOT_RUN_ID"),
               "resumed_from_step": resumed_from, "code_version": code_version(),
               "data_version": task.data_version}

    def on_commit(m: Manifest, stats: dict[str, Any]) -> None:
        uri = repo.uri(m.name)
        reporter.log(f"checkpoint committed: step {m.step} -> {uri} "
                     f"({m.total_size} bytes, {stats['save_seconds']:.2f}s)")
        reporter.event("checkpoint", uri=uri, name=m.name, step=m.step, parent=m.parent,
                       sha256=m.sha256, size=m.total_size, loss=m.meta.get("loss"),
                       eval=m.meta.get("metrics"), **stats, lineage=lineage)

    ck.on_commit = on_commit

    def save(reason: str) -> None:
        is_best = reason == "best"
        meta = {"reason": reason, "epoch": sampler.epoch, "position": sampler.position,
                "loss": loop.losses[-1] if loop.losses else None, "metrics": loop.metrics,
                "best_score": loop.best_score, "is_best": is_best, "lineage": lineage,
                "config": cfg.to_dict()}
        ck.save(loop.step, meta)

    progress = Progress(cfg.max_steps, loop.step)
    last_save_t = time.monotonic()
    last_beat = 0.0
    try:
        while loop.step < cfg.max_steps:
            if stop.requested:
                reporter.log(f"{stop.signal_name}: committing a checkpoint at step {loop.step}")
                save("preempted")
                ck.close()
                reporter.event("stopped", signal=stop.signal_name, step=loop.step)
                return 143
            step = loop.step + 1
            if task.before_step:
                task.before_step(step)
            model.train()
            batch = task.collate([task.train_data[i] for i in sampler.next_batch()])
            loss = task.loss_fn(model, batch)
            if not torch.isfinite(loss):
                raise DivergedError(f"loss is {loss.item()} at step {step}; the last good "
                                    f"checkpoint is step {ck.last_saved_step}. Lower optim.lr "
                                    "or check the data, then start a new run.")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            scheduler.step()
            loop.step = step
            loop.losses.append(loss.item())
            log.debug("step %d done loss %r", step, loop.losses[-1])
            progress.update(step, loop.losses[-1], scheduler.get_last_lr()[0])

            reasons = []
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.max_steps):
                model.eval()
                loop.metrics = {k: float(v) for k, v in task.eval_fn(model).items()}
                reporter.event("eval", step=step, **loop.metrics)
                if loop.metrics.get("loss", math.inf) < loop.best_score:
                    loop.best_score = loop.metrics["loss"]
                    if cfg.checkpoint.on_best:
                        reasons.append("best")
            c = cfg.checkpoint
            if c.every_steps and step % c.every_steps == 0:
                reasons.append("interval")
            if c.every_seconds and time.monotonic() - last_save_t >= c.every_seconds:
                reasons.append("time")
            if c.on_epoch_end and sampler.epoch_finished:
                reasons.append("epoch_end")
            if step == cfg.max_steps:
                reasons.append("final")
            if reasons:
                save("best" if "best" in reasons else reasons[0])
                last_save_t = time.monotonic()
            now = time.monotonic()
            if c.heartbeat_seconds is not None and now - last_beat >= c.heartbeat_seconds:
                last_beat = now
                repo.heartbeat({"step": step, "attempt": attempt, "pid": os.getpid()})
                reporter.event("progress", step=step, loss=loop.losses[-1])
    finally:
        try:
            ck.close()
        except Exception:  # the original error is the one to report
            log.exception("background save failed while stopping")
    reporter.event("finished", step=loop.step, metrics=loop.metrics)
    reporter.log(f"training finished at step {loop.step}: {loop.metrics}")
    return 0
