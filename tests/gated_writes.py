"""Run `python -m trainer` with one checkpoint write made to hang or to fail, so that a test
can kill the trainer in the middle of a background save, or see a background save fail.

    python tests/gated_writes.py -m trainer --config ... (as for `python -m trainer`)

$GATED_SAVE: which save's write (1 = the attempt's first) is gated; $GATED_MODE: `hang`
(the write starts, then never finishes) or `fail` (the disk is full: ENOSPC). Nothing
else changes.
"""

import errno
import os
import runpy
import sys
import threading

import trainer.api.checkpointer as checkpointer

_nth = int(os.environ.get("GATED_SAVE", "2"))
_mode = os.environ.get("GATED_MODE", "hang")
_save = checkpointer._save
_calls = 0


def _gated_save(state, dest):
    global _calls
    _calls += 1
    if _calls != _nth:
        return _save(state, dest)
    step = state["loop"]["step"]
    print(f"write of step {step} gated ({_mode})", flush=True)
    if _mode == "fail":
        raise OSError(errno.ENOSPC, "No space left on device (injected)")
    _save(state, dest)  # the bytes are written; the write never returns to commit them
    threading.Event().wait()


checkpointer._save = _gated_save
assert sys.argv[1:3] == ["-m", "trainer"], "usage: gated_writes.py -m trainer ARGS..."
sys.argv = ["trainer", *sys.argv[3:]]
runpy.run_module("trainer", run_name="__main__", alter_sys=True)
