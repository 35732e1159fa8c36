"""Read a run's final checkpoint state back from S3 (for comparisons in tests)."""

from __future__ import annotations

from trainer.api.state_files import load_verified_state
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import open_store


def final_state_s3(uri: str, experiment: str = "default", run: str = "equiv") -> dict:
    repo = CheckpointRepo(open_store(uri), experiment, run)
    manifest, skipped = repo.find_latest_valid()
    assert manifest is not None and not skipped
    return load_verified_state(repo, manifest)
