"""What a warm run worker was loaded from: the project's Python files and the environment
read at an interpreter's start.

The run pool's server (`ckpt_assets.runs.fork_server`) imports the code location once and
forks every run worker from that state, so a run it starts after a file changed would run
the old code. It records this fingerprint before it imports anything (a file changed while
it imports is then seen as a change, never missed) and every request carries the
launcher's; one that differs makes the server exit, and a fresh one loads the new code.

Stat only (path, size, mtime): hashing every file's bytes on each launch would cost more
than the fork saves. An edit that keeps both size and mtime (a copy with `cp -p` of a file
of the same size) goes unseen; restart the pool by hand then (its server's pid is in
`server.json` beside its socket).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from ckpt_assets.runs.names import REPO_ROOT
from trainer.process.standby import READ_AT_START

# Where the code location's code lives: every run worker imports from these.
PROJECT_PACKAGES = (REPO_ROOT / "ckpt_assets", REPO_ROOT / "trainer")
# Dagster reads some of its own variables when it is imported; the rest of the environment
# is handed to each run worker as the launcher has it (`fork_server`).
ENV_PREFIXES = (*READ_AT_START, "DAGSTER_")


def python_files(roots: Iterable[Path]) -> list[Path]:
    """Every .py file under `roots` (a root that is a file counts itself), sorted."""
    found: set[Path] = set()
    for root in roots:
        root = Path(root)
        if root.is_file():
            found.add(root)
        elif root.is_dir():
            found.update(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    return sorted(found)


def code_fingerprint(roots: Iterable[Path] = PROJECT_PACKAGES,
                     env: Mapping[str, str] | None = None) -> str:
    """A digest of the .py files under `roots` (path, size, mtime) and of the variables an
    interpreter reads at start in `env` (default: this process's). The interpreter itself
    is compared apart (`dagster_private.RunCode`): the launcher's may not be the run's."""
    digest = hashlib.sha256()
    for path in python_files(roots):
        try:
            st = path.stat()
        except OSError:  # removed while listed: a change like any other
            continue
        digest.update(f"\0{path}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    env = os.environ if env is None else env
    for key in sorted(k for k in env if k.startswith(ENV_PREFIXES)):
        digest.update(f"\0{key}={env[key]}".encode())
    return digest.hexdigest()
