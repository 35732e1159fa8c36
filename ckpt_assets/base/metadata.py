"""Plain values and typed records as Dagster metadata.

Links: every URI a person may want to open is also recorded under a `<key>_link` key, typed
so that the Dagster UI renders it as one (`url` for s3:// and http(s) addresses, `path` for
a local file). The plain string keys stay as they are: the lineage report, the sensors
and users' own code read them with `.value`, and a `path` value would have to drop the
`file://` of the store's URI, changing what they compare.
"""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import unquote, urlparse

import dagster as dg

from trainer.checkpoints.records import CheckpointRecord


def to_metadata(values: dict[str, Any]) -> dict[str, Any]:
    """Plain values -> Dagster metadata (None -> null, dict/list -> JSON, inf/nan -> text)."""
    out: dict[str, Any] = {}
    for k, v in values.items():
        if isinstance(v, dg.MetadataValue):  # typed already (a link); some are tuples
            out[k] = v
        elif v is None:
            out[k] = dg.MetadataValue.null()
        elif isinstance(v, bool):
            out[k] = dg.MetadataValue.bool(v)
        elif isinstance(v, float) and not math.isfinite(v):
            out[k] = dg.MetadataValue.text(str(v))
        elif isinstance(v, dict | list | tuple):
            out[k] = dg.MetadataValue.json(v)
        else:
            out[k] = v
    return out


def link(uri: str | None) -> dg.MetadataValue | None:
    """`uri` as a link the Dagster UI renders: url for s3:// and http(s), path for a
    local file (file:// or an absolute path); None for anything else."""
    if not uri or not isinstance(uri, str):
        return None
    parsed = urlparse(uri)
    if parsed.scheme in ("s3", "http", "https"):
        return dg.MetadataValue.url(uri)
    if parsed.scheme == "file":
        return dg.MetadataValue.path(unquote(parsed.path))
    if uri.startswith("/"):
        return dg.MetadataValue.path(uri)
    return None


def links(values: dict[str, str | None]) -> dict[str, dg.MetadataValue]:
    """{key_link: link} for each value that is a link (the rest are left out)."""
    out = {}
    for k, v in values.items():
        lv = link(v)
        if lv is not None:
            out[f"{k}_link"] = lv
    return out


# Lineage metadata of every checkpoint materialization.
# `size`: all the checkpoint's files, in bytes; `part_bytes`: each part's tensor bytes;
# `blocking_seconds`: how long training waited for the save.
CHECKPOINT_METADATA_KEYS = ("step", "uri", "name", "sha256", "size", "part_bytes", "loss",
                            "parent", "parent_checkpoint", "save_seconds", "blocking_seconds",
                            "experiment", "training_run", "dagster_run_id", "root_run_id",
                            "attempt", "resumed_from_step",
                            "code_version", "user_code_version", "data_version", "dataset")


def checkpoint_metadata(rec: CheckpointRecord) -> dict[str, Any]:
    lin = rec.lineage
    return to_metadata({
        "step": rec.step, "uri": rec.uri, "name": rec.name, "sha256": rec.sha256,
        "size": rec.size, "part_bytes": rec.part_bytes or None, "loss": rec.loss,
        "parent": rec.parent,
        "parent_checkpoint": rec.parent, "save_seconds": rec.save_seconds,
        "blocking_seconds": rec.blocking_seconds, "eval": rec.eval or None,
        "reason": rec.reason,
        # `every_seconds: auto`: the interval that led here, and its inputs (stall, MTBF).
        "interval_seconds": rec.interval.every_seconds if rec.interval else None,
        "interval": rec.interval.to_dict() if rec.interval else None,
        "experiment": lin.experiment if lin else None,
        "training_run": lin.run if lin else None,
        "dagster_run_id": lin.dagster_run_id if lin else None,
        "root_run_id": lin.root_run_id if lin else None,
        "attempt": rec.attempt, "resumed_from_step": lin.resumed_from_step if lin else None,
        "code_version": lin.code_version if lin else None,
        "user_code_version": lin.user_code_version if lin else None,
        "data_version": lin.data_version if lin else None,
        "dataset": lin.dataset if lin else None,
    }) | links({"uri": rec.uri, "dataset": lin.dataset if lin else None})
