"""The checkpoint a session resumes from: `auto` (the newest that verifies), `never`, or an
explicit URI of one of the run's own checkpoints."""

from __future__ import annotations

from ..base.errors import ConfigError
from ..storage import open_store, split_uri
from .manifest import Manifest
from .repo import CheckpointRepo


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
            f"resume point {resume!r} belongs to another experiment/run than "
            f"{repo.experiment}/{repo.run}; a run resumes only from its own checkpoints "
            "(pass one of them, or auto)"
        )
    if open_store(store_uri).uri != repo.store.uri:
        raise ConfigError(f"resume point {resume!r} is not in the store {repo.store.uri}; "
                          "pass the store that holds it")
    return repo.verify(name), []
