"""The one error of starting an attempt's process: bad input in the run's config or the
trainer's settings (no such command, not executable, bad cwd, a transport or pod spec that
cannot work). `model_checkpoint` records it as `bad_input`, which is never resumed."""


class TrainerStartError(Exception):
    """The attempt's process could not be started; the message says what to fix."""
