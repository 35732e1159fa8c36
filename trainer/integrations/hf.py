"""Hugging Face `Trainer`, crash-safe: each save it makes is one committed checkpoint.

    from ckpt_trainer.integrations.hf import train
    train(trainer)                      # in place of trainer.train()

`train` adds a `CheckpointCallback` to the trainer (or uses the one it was given), restores
the newest verified checkpoint of the run into `output_dir/checkpoint-N` and resumes the
Trainer from it (no `resume_from_checkpoint` to pass), and ends the process as a session
does: 0 at the end, 143 after SIGTERM/SIGINT once the step it stopped at is committed, the
trainer's exit codes for its errors. The session's arguments (`run`, `store`, `keep_last`,
...) pass through; under the orchestrator (`command:` runs) its environment names them.

What is committed is the Trainer's own `checkpoint-N/` (weights, optimizer, scheduler, RNG
states, `trainer_state.json` with the log history), through the commit protocol: written
once, with a manifest of hashes, verified before it is restored, retained by `keep_last` /
`keep_best` (the Trainer's local folders stay under its own `save_total_limit`). Saves stay
the Trainer's (`save_steps`, `save_strategy`); a stop request and the last step add one.

A stop commits at an optimizer step's end: the callback asks the Trainer to save and stop
at the next `on_step_end`, and commits in `on_save`. The session's per-step call is made
only there, once the Trainer's files of that step exist, so no commit can hold the files of
an earlier step; between saves the callback reports progress to the heartbeat.

Where the Trainer's own resume is not exact, say so (docs/frameworks.md): its running loss
starts at zero on resume, so a log entry that averages several steps (`logging_steps` > 1)
and spans the stop averages only the resumed steps; with `logging_steps=1` (or saves on
logging steps) the log history is bitwise the uninterrupted one's, as are weights and
optimizer state.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback

from ..api.session import CheckpointSession
from ..base.errors import ConfigError
from .files import FrameworkFiles

log = logging.getLogger("trainer")
PART = "hf_trainer"  # the part's name in a checkpoint


class CheckpointCallback(TrainerCallback):
    """Commits each checkpoint the Trainer saves; turns SIGTERM/SIGINT into a save and a
    stop. `session`: a `CheckpointSession` of your own (default: one made from
    `session_args`)."""

    def __init__(self, session: CheckpointSession | None = None, **session_args: Any):
        self.session = session if session is not None else CheckpointSession(**session_args)
        self.files = FrameworkFiles("the Hugging Face Trainer")
        self.restored = False

    def restore(self, output_dir: str, model: Any = None) -> str | None:
        """Restore the session; the `checkpoint-N` folder to pass as
        `Trainer.train(resume_from_checkpoint=...)`, None to start fresh. `model` (the
        Trainer's) is committed as the part `model` too: what the orchestrator's
        `final_model` exports, and what a reader of the store finds without the Trainer."""
        if self.restored:
            raise ConfigError("the callback restored its checkpoint already; one restore "
                              "per process, before trainer.train()")
        self.files.home = Path(output_dir)
        parts = {PART: self.files, **({"model": model} if model is not None else {})}
        step = self.session.restore(parts)
        self.restored = True
        return str(self.files.source) if step else None

    def on_train_begin(self, args, state, control, **kwargs):
        if not self.restored:
            raise ConfigError(
                "CheckpointCallback: trainer.train() began before the callback restored the "
                "run; call ckpt_trainer.integrations.hf.train(trainer), or pass "
                "resume_from_checkpoint=callback.restore(args.output_dir, model) to trainer.train()")
        if state.max_steps and state.max_steps > 0:
            self.session.max_steps = state.max_steps

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        log.debug("step %d done", step)
        if self.session.stop_requested:
            control.should_save = control.should_training_stop = True
        elif step >= state.max_steps:
            control.should_save = True  # the last step is committed, as the final one
        else:
            beat = self.session._beat
            if beat is not None:
                beat.advance(step)
        return control

    def on_save(self, args, state, control, **kwargs):
        step, session = state.global_step, self.session
        self.files.wrote(Path(args.output_dir) / f"checkpoint-{step}", step)
        if step < 1:
            return control  # before the first step: nothing trained, nothing to commit
        if step > session.loop.step:
            if session.step(step, loss=_last_loss(state, step)):
                control.should_training_stop = True
                return control
        if session._ck.last_saved_step != step:
            session.save("interval")
        return control


def _last_loss(state, step: int) -> float | None:
    """The loss the Trainer logged at `step`, if it logged one there."""
    for entry in reversed(state.log_history):
        if entry.get("step") == step and "loss" in entry:
            return entry["loss"]
        if entry.get("step", step) < step:
            return None
    return None


def train(trainer: Trainer, **session_args: Any):
    """`Trainer.train()`, crash-safe and resumed from the run's newest verified checkpoint
    (module docstring); what `Trainer.train()` returns. Ends the process with 143 after a
    stop request, once its step is committed."""
    callback = next((c for c in trainer.callback_handler.callbacks
                     if isinstance(c, CheckpointCallback)), None)
    if callback is None:
        callback = CheckpointCallback(**session_args)
        trainer.add_callback(callback)
    elif session_args:
        raise ConfigError("the trainer has a CheckpointCallback already: pass the session's "
                          f"arguments ({', '.join(session_args)}) to it, not to train()")
    if callback.session.max_steps is None and trainer.args.max_steps > 0:
        callback.session.max_steps = trainer.args.max_steps  # a raised target trains on
    with callback.session:
        resume = callback.restore(trainer.args.output_dir, trainer.model)
        return trainer.train(resume_from_checkpoint=resume)
