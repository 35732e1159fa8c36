"""Discovery and verification: which checkpoint of a run to load, and whether its bytes are
the ones its manifest describes.

Discovery reads latest.json, then verifies the manifest's sizes and SHA-256 digests before
anything is deserialized. If verification fails it walks back to the newest older
checkpoint that verifies, and says so loudly in the log. Functions over a `RunLayout`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import BinaryIO

from ..base.errors import CheckpointError, CheckpointNotFoundError, InvalidNameError
from ..storage.base import CHUNK_SIZE, chunk_digests, combine_chunks, file_size
from .layout import RunLayout, committed, read_pointer
from .manifest import MANIFEST, Manifest, parse_checkpoint_name
from .pointer import Pointer

log = logging.getLogger("trainer.checkpoint")

# What verification raises for a checkpoint that cannot be used.
UNUSABLE = (CheckpointError, CheckpointNotFoundError, InvalidNameError)


def read_manifest(layout: RunLayout, name: str) -> Manifest:
    """The manifest of checkpoint `name`, checked to belong to it and to this run."""
    key = layout.key(name, MANIFEST)
    try:
        data = layout.store.read_bytes(key)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(
            f"checkpoint {layout.uri(name)} does not exist (no {MANIFEST}); pass one of the "
            f"run's checkpoints, or resume from the newest that verifies (`auto`, the "
            f"default of --resume and of CheckpointSession)"
        ) from e
    where = layout.store.uri_for(key)
    m = Manifest.from_json(data, where)
    if m.name != name:
        raise CheckpointError(f"manifest {where} names {m.name!r}, not {name!r}")
    parsed = parse_checkpoint_name(name)
    if parsed and parsed[:2] != (m.step, m.attempt):
        raise CheckpointError(f"manifest {where} says step {m.step}, attempt {m.attempt}; "
                              f"its name says otherwise (it is corrupt)")
    if m.experiment is not None and (m.experiment, m.run) != (layout.experiment, layout.run):
        raise CheckpointError(
            f"manifest {where} belongs to run {m.experiment}/{m.run}, not "
            f"{layout.experiment}/{layout.run}: it was copied from another run and is not "
            "loaded. Remove it, or resume that run with its own config."
        )
    _check_lineage_agrees(m, where)
    return m


def _check_lineage_agrees(m: Manifest, where: str) -> None:
    """The lineage a manifest carries names the run it was written for too: a manifest whose
    `run` was edited to pass as this run's still names the other one there."""
    lineage = m.meta.get("lineage")
    if not isinstance(lineage, dict):
        return
    for key in ("experiment", "run"):
        said, recorded = getattr(m, key), lineage.get(key)
        if said is not None and recorded is not None and said != recorded:
            raise CheckpointError(
                f"manifest {where} says {key} {said!r} but its lineage names {recorded!r}: "
                "it was edited or copied from another run and is not loaded. Remove it, or "
                "resume the run it belongs to.")


def verify_file(layout: RunLayout, manifest: Manifest, filename: str, f: BinaryIO) -> None:
    """Check size and SHA-256 of an open file against the manifest (CheckpointError).

    Multi-chunk files are hashed chunk by chunk on all cores when the file has a
    descriptor; the error names the first chunk that does not match.
    """
    want = manifest.files[filename]
    uri = layout.uri(manifest.name, filename)
    size = file_size(f)
    if size != int(want["size"]):
        raise CheckpointError(
            f"checkpoint file {uri} is {size} bytes but its manifest says {want['size']} "
            "(truncated or corrupt)"
        )
    if want.get("chunks"):
        _verify_chunks(uri, want, f, size)
        return
    sha = hashlib.sha256()
    f.seek(0)
    for block in iter(lambda: f.read(8 << 20), b""):
        sha.update(block)
    if sha.hexdigest() != want["sha256"]:
        raise CheckpointError(
            f"checkpoint file {uri} has SHA-256 {sha.hexdigest()} but its manifest says "
            f"{want['sha256']} (corrupt)"
        )


def _verify_chunks(uri: str, want: dict, f: BinaryIO, size: int) -> None:
    chunks = want["chunks"]
    if combine_chunks(chunks) != want["sha256"]:
        raise CheckpointError(f"manifest of {uri} lists chunk digests that do not add "
                              "up to its SHA-256 (the manifest is corrupt)")
    chunk_size = int(want.get("chunk_size", CHUNK_SIZE))
    got = chunk_digests(f, size, chunk_size)
    for i, (g, w) in enumerate(zip(got, chunks, strict=True)):
        if g != w:
            raise CheckpointError(
                f"checkpoint file {uri} does not match its manifest: chunk {i} "
                f"(bytes {i * chunk_size}..) has SHA-256 {g}, manifest says {w} (corrupt)"
            )


def verify(layout: RunLayout, name: str) -> Manifest:
    """Read the manifest and check every file's size and SHA-256; raise CheckpointError."""
    m = read_manifest(layout, name)
    for filename in m.files:
        try:
            f = layout.store.open_read(layout.key(name, filename))
        except FileNotFoundError as e:
            raise CheckpointError(
                f"checkpoint file {layout.uri(name, filename)} listed in its manifest is "
                "missing"
            ) from e
        with f:
            verify_file(layout, m, filename, f)
    return m


def candidates(layout: RunLayout,
               pointer: Callable[[RunLayout], Pointer | None] = read_pointer) -> list[str]:
    """Checkpoints to try, newest first: the pointer's, then its history.

    The pointer is authoritative: a manifest it never named (a save that lost the
    pointer race, or was cut off before step 3) is not part of the run's history.
    Only when the pointer is unreadable, or missing although manifests exist (it was
    deleted: a claim writes it before any manifest), do we fall back to scanning every
    manifest, newest attempt first. `pointer` reads it (a writer remembers what it read).
    """
    try:
        ptr = pointer(layout)
    except CheckpointError as e:
        log.error("CHECKPOINT FALLBACK: %s; scanning all committed checkpoints instead", e)
        return scan(layout)
    if ptr is None:
        scanned = scan(layout)
        if scanned:
            log.error("CHECKPOINT FALLBACK: %s is missing but %d committed checkpoint(s) "
                      "exist; scanning them", layout.pointer_uri, len(scanned))
        return scanned
    return ptr.timeline


def scan(layout: RunLayout) -> list[str]:
    """Every committed checkpoint, newest attempt first (without the pointer)."""
    names = committed(layout)
    order = [parse_checkpoint_name(n) for n in names]
    if all(order):
        # A later attempt supersedes an earlier one whatever their steps: an earlier
        # attempt's newer step can only be a save that lost the race for the pointer.
        return [n for _, n in sorted(zip(order, names, strict=True),
                                     key=lambda t: (t[0][1], t[0][0], t[0][2]), reverse=True)]
    return list(reversed(names))


def find_latest_valid(layout: RunLayout,
                      pointer: Callable[[RunLayout], Pointer | None] = read_pointer
                      ) -> tuple[Manifest | None, list[tuple[str, str]]]:
    """Newest checkpoint that verifies, and the (name, reason) of each one skipped."""
    skipped: list[tuple[str, str]] = []
    for name in candidates(layout, pointer):
        try:
            m = verify(layout, name)
        except UNUSABLE as e:
            skipped.append((name, str(e)))
            log.error("CHECKPOINT FALLBACK: skipping %s: %s", layout.uri(name), e)
            continue
        if skipped:
            log.error(
                "CHECKPOINT FALLBACK: resuming from %s (step %d) because %d newer "
                "checkpoint(s) failed verification", layout.uri(name), m.step, len(skipped)
            )
        return m, skipped
    return None, skipped
