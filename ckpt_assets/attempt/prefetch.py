"""What a run's last steps import, imported by the run worker while its trainer trains.

After the last step, `model_checkpoint` tabulates and plots the run's history (pandas,
matplotlib's Agg canvas), and `final_model` loads the final checkpoint (torch), rebuilds and
evaluates the task's model (the trainer's task and loop). In a fresh run worker those
imports alone take about 2.5 s (several on a busy machine), all of it between the last step
and the run's success. The run worker has nothing to do while `model_checkpoint` waits on
its trainer, so one background thread imports them then, in the order they are used, once
the trainer has reported a step in the last tenth of its steps (never against its start-up,
and not for an attempt interrupted earlier: most of a long job's attempts are; a trainer
that does not say how many steps it trains, once it has spoken).

Best effort: an import that fails here fails again, with its traceback, where it is used.
Not a daemon thread: the interpreter waits for it at exit. A run interrupted moments after
its trainer spoke exits while it may still be importing, and a daemon thread stopped inside
an extension module's C code at interpreter exit can crash the process ("Fatal Python
error: ... finalizing"), ending `dagster asset materialize` by SIGABRT instead of exit 1.
"""

from __future__ import annotations

import importlib
import threading

END_OF_RUN_IMPORTS = ("pandas", "matplotlib.backends.backend_agg", "matplotlib.figure",
                      "torch")
# Only where final_model evaluates a task (not a command's model). Not torch._dynamo, which
# torch.optim imports once an optimizer takes its parameters: evaluating a task builds its
# optimizer only if the task's `build` does (the default optimizer, or one given as a
# function of the model, is never built there), and importing it ahead cost every run
# worker 1.5 s of CPU and about 100 MB for an import its run never made.
EVALUATION_IMPORTS = ("trainer.loop", "trainer.api.task")

_started = threading.Lock()
_thread: threading.Thread | None = None


def _import_all(names: tuple[str, ...]) -> None:
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - reported where it is imported for use
            return


def prefetch_end_of_run_imports(evaluates: bool) -> None:
    """Start importing `END_OF_RUN_IMPORTS` (and `EVALUATION_IMPORTS` if final_model
    `evaluates` a task) in the background, once per process."""
    global _thread
    with _started:
        if _thread is None:
            names = END_OF_RUN_IMPORTS + (EVALUATION_IMPORTS if evaluates else ())
            _thread = threading.Thread(target=_import_all, args=(names,),
                                       name="end-of-run-imports")
            _thread.start()
