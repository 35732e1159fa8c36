"""Where a standalone session keeps its run when nothing names a store, and what it says
when it starts a run from scratch there.

The default is `checkpoints/` in the directory the script runs in, as for any file a
program writes by a relative name. Run from another directory, the same script starts
another run there: the line that says "from scratch" names the store, and a run of the
same name kept beside the script is pointed to, so that a resume missed is never silent.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..checkpoints.repo import CheckpointRepo
from ..storage import open_store


def default_store() -> str:
    return os.path.abspath("checkpoints")


def from_scratch_words(store_uri: str, experiment: str, run: str, attempt: int) -> str:
    what = f"starting {experiment}/{run} from scratch (attempt {attempt}) in store {store_uri}"
    if store_uri != default_store():
        return what
    what += (" (the default: ./checkpoints where this runs; pass store= or set "
             "CKPT_STORE_URI for another)")
    if (beside := _kept_beside_the_script(experiment, run)) is not None:
        where, step = beside
        what += (f". {where} holds this run at step {step}: to continue it, run from "
                 f"{Path(where).parent} or set CKPT_STORE_URI={where}")
    return what


def _kept_beside_the_script(experiment: str, run: str) -> tuple[str, int] | None:
    """(the store, its step) where `checkpoints/` beside the running script holds the run,
    when that is not the default store of this directory."""
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else None
    if script is None:
        return None
    beside = os.path.join(os.path.dirname(os.path.abspath(script)), "checkpoints")
    if beside == default_store() or not os.path.isdir(beside):
        return None
    try:
        ptr = CheckpointRepo(open_store(beside), experiment, run).read_pointer()
    except Exception:  # a hint only: an unreadable folder beside the script is not an error
        return None
    return (beside, ptr.step) if ptr is not None and ptr.checkpoint else None
