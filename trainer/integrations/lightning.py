"""Lightning `Trainer`, crash-safe: each checkpoint it saves is one committed checkpoint.

    from ckpt_trainer.integrations.lightning import fit
    fit(trainer, model, datamodule=dm)     # in place of trainer.fit(model, datamodule=dm)

`fit` puts a `CheckpointIO` of ours on the trainer's strategy (Lightning's own file writer,
then a commit of that file) and a `CheckpointCallback`, restores the newest verified
checkpoint of the run and passes it as Lightning's own `fit(ckpt_path=...)`, and ends the
process as a session does: 0 at the end, 143 after SIGTERM/SIGINT once the step it stopped
at is committed. The session's arguments (`run`, `store`, `keep_last`, ...) pass through.
To build the trainer with them yourself: `Trainer(plugins=[SessionCheckpointIO(cb)],
callbacks=[cb])` with `cb = CheckpointCallback(...)`, and `cb.restore(trainer, model)` as
`ckpt_path`.

Saves stay Lightning's (`ModelCheckpoint`, `Trainer.save_checkpoint`); a stop request and
the last step add one, written to `<default_root_dir>/checkpoints/`, where restored
checkpoints go too. Lightning saves no generator states, so the committed checkpoint holds
the session's (`rng`); they are put back at the first resumed batch, where the interrupted
run stood when it committed: Lightning's start-up between `restore` and that batch draws
nothing the interrupted run drew after its commit. Mid-epoch, Lightning continues exactly
only with a stateful loader (torchdata's StatefulDataLoader, whose state it saves itself);
with a plain DataLoader a resume replays the epoch's batches from its start (Lightning's
own limit: docs/frameworks.md).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..api.checkpointer import RNGState
from ..api.session import CheckpointSession
from ..base.errors import ConfigError
from .files import FrameworkFiles

log = logging.getLogger("trainer")
PART = "lightning"  # the part's name in a checkpoint


class CheckpointCallback(Callback):
    """Commits each checkpoint Lightning saves (through `SessionCheckpointIO`); turns
    SIGTERM/SIGINT into a save and a stop; sets the generators back at a resume."""

    def __init__(self, session: CheckpointSession | None = None, **session_args: Any):
        self.session = session if session is not None else CheckpointSession(**session_args)
        self.files = FrameworkFiles("Lightning")
        self.restored = False
        self.trainer: Trainer | None = None
        self.losses: list[float] = []  # each training step's, across attempts
        self._generators: dict[str, Any] | None = None  # to set at the first resumed batch

    def restore(self, trainer: Trainer, model: Any = None) -> str | None:
        """Restore the session; the `.ckpt` to pass as `ckpt_path`, None to start fresh.
        `model` (the LightningModule) is committed as the part `model` too: what the
        orchestrator's `final_model` exports, and what a reader of the store finds."""
        if self.restored:
            raise ConfigError("the callback restored its checkpoint already; one restore "
                              "per process, before trainer.fit()")
        self.trainer = trainer
        self.files.home = Path(trainer.default_root_dir) / "checkpoints"
        if self.session.max_steps is None and trainer.max_steps > 0:
            self.session.max_steps = trainer.max_steps
        step = self.session.restore({PART: self.files,
                                     **({"model": model} if model is not None else {})})
        self.restored = True
        if not step:
            return None
        self._generators = RNGState().state_dict()  # as the session restored them
        return str(self.files.source)

    def committed(self, path: str, step: int) -> bool:
        """Lightning wrote `path` at `step`: commit it (once per step); True: stop."""
        session = self.session
        self.files.wrote(path, step)
        if step < 1:
            return False  # before the first step (a save at the start): nothing trained
        loss = self.losses[-1] if self.losses else None
        if step > session.loop.step and session.step(step, loss=loss):
            self.trainer.should_stop = True  # SIGINT too, which Lightning leaves to us
            return True
        if session._ck.last_saved_step != step:
            session.save("interval")
        return False

    def state_dict(self) -> dict[str, Any]:
        """Lightning keeps no loss history in its checkpoints: this callback's state does."""
        return {"losses": list(self.losses)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.losses = list(state_dict.get("losses", []))

    def on_train_start(self, trainer, pl_module):
        if not self.restored:
            raise ConfigError(
                "CheckpointCallback: trainer.fit() began before the callback restored the "
                "run; call ckpt_trainer.integrations.lightning.fit(trainer, model, ...)")
        if not isinstance(trainer.strategy.checkpoint_io, SessionCheckpointIO):
            raise ConfigError("CheckpointCallback needs SessionCheckpointIO as the trainer's "
                              "checkpoint plugin: Trainer(plugins=[SessionCheckpointIO(cb)])")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._generators is not None:
            RNGState().load_state_dict(self._generators)
            self._generators = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.losses.append(loss.item())
        log.debug("step %d done", step)
        last = trainer.max_steps > 0 and step >= trainer.max_steps
        if self.session.stop_requested or last:
            trainer.save_checkpoint(self.files.home / f"step={step}.ckpt")
        elif (beat := self.session._beat) is not None:
            beat.advance(step)


class SessionCheckpointIO(TorchCheckpointIO):
    """Lightning's file writer, each file then committed by `callback`'s session."""

    def __init__(self, callback: CheckpointCallback):
        super().__init__()
        self.callback = callback

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options=None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        self.callback.committed(str(path), int(checkpoint["global_step"]))


def fit(trainer: Trainer, model, *args: Any, **kwargs: Any) -> None:
    """`Trainer.fit(model, ...)`, crash-safe and resumed from the run's newest verified
    checkpoint (module docstring). Session arguments go in `session=dict(...)`; ends the
    process with 143 after a stop request, once its step is committed."""
    callback = next((c for c in trainer.callbacks if isinstance(c, CheckpointCallback)), None)
    session_args = kwargs.pop("session", None) or {}
    if callback is None:
        callback = CheckpointCallback(**session_args)
        trainer.callbacks.insert(0, callback)
    if not isinstance(trainer.strategy.checkpoint_io, SessionCheckpointIO):
        trainer.strategy.checkpoint_io = SessionCheckpointIO(callback)
    if "ckpt_path" in kwargs:
        raise ConfigError("fit() picks the checkpoint to continue from (the run's newest "
                          "verified one); drop ckpt_path")
    with callback.session:
        try:
            trainer.fit(model, *args, ckpt_path=callback.restore(trainer, model),
                        **kwargs)
        except SIGTERMException:
            if not callback.session.stopped:
                raise  # a stop this session did not commit: Lightning's own exit
