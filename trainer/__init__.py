"""Standalone, resumable PyTorch trainer with a crash-safe checkpoint store.

Never imports dagster: it runs on its own, under torchrun, or in a container.

The public API for your own training loop:

    from trainer import CheckpointSession, ResumableLoader

Both are imported on first use, so `import trainer` (and `python -m trainer --help`)
stays fast.
"""

__all__ = ["CheckpointSession", "ResumableLoader"]


def __getattr__(name: str):
    if name == "CheckpointSession":
        from trainer.session import CheckpointSession

        return CheckpointSession
    if name == "ResumableLoader":
        from trainer.data import ResumableLoader

        return ResumableLoader
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
