"""Run a Hugging Face Trainer script with every optimizer step slowed down by $STEP_DELAY
seconds (in `CheckpointCallback.on_step_end`), so that a test can signal it in the middle of
a run; nothing else changes (tests/slow_steps.py does the same for `CheckpointSession.step`).

    python tests/slow_hf_steps.py SCRIPT [ARGS...]
"""

import os
import runpy
import sys
import time

from trainer.integrations.hf import CheckpointCallback

_delay = float(os.environ.get("STEP_DELAY", "0.05"))
_step_end = CheckpointCallback.on_step_end


def _slow_step_end(self, *args, **kwargs):
    time.sleep(_delay)
    return _step_end(self, *args, **kwargs)


CheckpointCallback.on_step_end = _slow_step_end
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
