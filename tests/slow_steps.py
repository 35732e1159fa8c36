"""Run a training script with every `CheckpointSession.step` slowed down by $STEP_DELAY
seconds, so that a test can signal it in the middle of a run; nothing else changes.

    python tests/slow_steps.py SCRIPT [ARGS...]
    python tests/slow_steps.py -m MODULE [ARGS...]
"""

import os
import runpy
import sys
import time

from trainer.api.session import CheckpointSession

_delay = float(os.environ.get("STEP_DELAY", "0.05"))
_step = CheckpointSession.step


def _slow_step(self, *args, **kwargs):
    time.sleep(_delay)
    return _step(self, *args, **kwargs)


CheckpointSession.step = _slow_step
if sys.argv[1] == "-m":
    sys.argv = sys.argv[2:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
