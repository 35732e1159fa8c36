"""Code versions for lineage: ours, and that of the user's code being trained.

A version is the git commit of the repository that holds the code, with `+dirty` when it
has uncommitted changes (then a resumed attempt may not run the same code); outside a git
repository it is `sha256:<hex>` over the Python files beside the code, so a change to them
still shows.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from pathlib import Path

from .contract import Env

HERE = Path(__file__).resolve().parent


def _git(cwd: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=cwd)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _content_hash(directory: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(directory.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return "sha256:" + h.hexdigest()[:16]


@functools.cache
def code_version_of(path: str | os.PathLike) -> str | None:
    """The version of the code at `path` (a file or directory); None if it does not exist."""
    p = Path(path).resolve()
    directory = p if p.is_dir() else p.parent
    if not directory.is_dir():
        return None
    commit = _git(directory, "rev-parse", "HEAD")
    if commit:
        status = _git(directory, "status", "--porcelain", "--untracked-files=no")
        return commit + ("+dirty" if status else "")
    return _content_hash(directory)


def ckpt_assets_version() -> str | None:
    """This project's own version: $CKPT_CODE_VERSION (set by the orchestrator) or git."""
    return os.environ.get(Env.CODE_VERSION) or code_version_of(HERE)
