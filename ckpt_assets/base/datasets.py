"""What a training run trains on, recorded by reference: the `training_dataset` value.

A dataset URI (local file or directory, `s3://` prefix) is versioned by its content
manifest (`trainer.checkpoints.dataset`); data the task generates is versioned by what generates it
(the task, its arguments and the seed). No bytes travel through Dagster. A dataset whose
version differs from the one the run's checkpoints were trained on is refused: resuming
on other data is not a resume.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

from ckpt_assets.base.registration import Registration
from trainer.base import strict_json
from trainer.base.errors import CheckpointError
from trainer.checkpoints.dataset import check_same_data, dataset_manifest
from trainer.checkpoints.records import Lineage, from_known_fields
from trainer.checkpoints.repo import CheckpointRepo


@dataclass(frozen=True)
class DatasetRecord:
    kind: str  # "uri" | "generated"
    version: str
    uri: str | None = None
    files: int | None = None
    bytes: int | None = None
    generator: dict[str, Any] | None = None  # task, task_args, seed (generated data)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DatasetRecord:
        """From the stored `training_dataset` value (which also holds the file manifest)."""
        return from_known_fields(cls, raw)


def describe_dataset(reg: Registration, s3_client=None) -> tuple[DatasetRecord, dict[str, Any]]:
    """The run's dataset record and its manifest (per-file entries; empty when generated)."""
    cfg = reg.config
    if cfg.dataset:
        m = dataset_manifest(cfg.dataset, s3_client=s3_client)
        return DatasetRecord("uri", m.version, m.uri, len(m.files), m.total_bytes), m.files
    generator = {"task": cfg.task, "task_args": cfg.task_args, "seed": cfg.seed}
    body = strict_json.dumps(generator, sort_keys=True, separators=(",", ":")).encode()
    return DatasetRecord("generated", hashlib.sha256(body).hexdigest(),
                         generator=generator), {}


def refuse_changed_data(repo: CheckpointRepo, dataset: DatasetRecord) -> None:
    """ConfigError when the run's current checkpoint was trained on another version."""
    if dataset.kind != "uri":
        return
    try:
        ptr = repo.read_pointer()
        if not ptr or not ptr.checkpoint:
            return
        m = repo.read_manifest(ptr.checkpoint)
    except CheckpointError:
        return  # the trainer's own discovery walks back and checks again
    lineage = Lineage.from_dict(m.meta.get("lineage"))
    check_same_data(lineage.data_version, dataset.version, repo.uri(m.name))
