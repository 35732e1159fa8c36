"""The store a command works in: `--store`, else $CKPT_STORE_URI, else `checkpoints/` under
the repository root (the code location's default, `defs.resources.default_store_uri`)."""

from __future__ import annotations

import os

from trainer.base.errors import ConfigError
from trainer.process.contract import Env
from trainer.storage import ObjectStore, open_store


def store_of(uri: str | None) -> ObjectStore:
    from ckpt_assets.defs.resources import default_store_uri

    return open_store(uri or default_store_uri())


def train_here_in(store: ObjectStore) -> None:
    """`run` trains in this process: its assets, their resources and the trainer they start
    read the store from $CKPT_STORE_URI when the run starts, so the store the command names
    is put there, for the whole run (registered, trained and summed up in one store)."""
    os.environ[Env.STORE_URI] = store.uri


def launched_runs_store(name: str, asked: str | None, store: ObjectStore) -> None:
    """A launched run trains in the store of the code location the daemon serves (its
    $CKPT_STORE_URI, else ./checkpoints of the repository), and its resumes are decided
    there: a `--store` that `launch` cannot hand on is refused, never silently dropped."""
    if asked is None or store.uri == (default := store_of(None)).uri:
        return
    raise ConfigError(
        f"--store {asked}: a launched run trains in the store of the code location the "
        f"daemon loads ($CKPT_STORE_URI there; {default.uri} here), not in one named on "
        "this command line. Set CKPT_STORE_URI to it for dagster-daemon (or dagster dev) "
        f"and for this command, or train without a daemon: ckpt-assets run {name} "
        f"--store {asked}")
