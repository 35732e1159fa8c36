"""Standalone, resumable PyTorch trainer with a crash-safe checkpoint store.

Never imports dagster: it runs on its own, under torchrun, or in a container.

The public API, for your own training loop and for a task of the trainer's loop, under the
name every project can import (`ckpt_trainer`: a project's own `trainer.py` never shadows
it):

    from ckpt_trainer import CheckpointSession, ResumableLoader
    from ckpt_trainer import Task, TaskArgs, ConfigError

Each is imported on first use, so `import trainer` (and `python -m trainer --help`) stays
fast. The packages are layers, each looking only down: `base` (the vocabulary), `storage`
(object stores), `checkpoints` (the commit protocol), `process` (signals, liveness, the
orchestrator's contract), `ranks` (several ranks, sharding), `api` (the user API); above
them the trainer's own loop (`loop`, `config`, `cli`) and `integrations` (the Hugging Face
and Lightning Trainers on the user API, each imported only by its user).
"""

import importlib

# name -> the module (relative to this package) that defines it
PUBLIC = {
    "CheckpointSession": ".api.session",
    "ResumableLoader": ".api.data",
    "Task": ".api.task",
    "TaskArgs": ".api.task",
    "ConfigError": ".base.errors",
}
__all__ = sorted(PUBLIC)


def __getattr__(name: str):
    if name in PUBLIC:
        return getattr(importlib.import_module(PUBLIC[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
