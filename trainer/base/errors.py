"""Error classes of the trainer, each tied to one outcome (and so one exit code).

The outcome is the contract with the orchestrator's failure policy: it decides whether a
failed run is worth resuming, so every error the trainer can foresee maps to one row of
`trainer.base.outcomes.Outcome`.
"""

from .outcomes import Outcome


class TrainerError(Exception):
    """Base class: an error the trainer foresaw, with the outcome that reports it."""

    outcome = Outcome.USER_CODE_ERROR

    @property
    def exit_code(self) -> int:
        return self.outcome.exit_code

    @property
    def failure_class(self) -> str:
        return self.outcome.value


class ConfigError(TrainerError):
    """The config, a CLI argument or another input is wrong; retrying cannot help."""

    outcome = Outcome.BAD_INPUT


class InvalidNameError(ConfigError):
    """An experiment, run or key name that is not allowed (it could escape the store)."""


class CheckpointError(TrainerError):
    """A checkpoint exists but cannot be used: corrupt, truncated, unsafe or incompatible."""

    outcome = Outcome.CHECKPOINT_UNLOADABLE


class CheckpointNotFoundError(ConfigError):
    """An explicitly requested checkpoint does not exist (a wrong URI is bad input)."""


class DivergedError(TrainerError):
    """The loss became NaN or infinite."""

    outcome = Outcome.DIVERGED


class StorageError(TrainerError):
    """The store could not be reached or answered with errors after retries."""

    outcome = Outcome.STORAGE_UNAVAILABLE


class AlreadyExistsError(StorageError):
    """A create-once write found the name taken: never overwrite a committed object."""


class LockHeldError(StorageError):
    """A write that needs a lock found it held by a process that is stopped or stuck."""


class PointerConflictError(TrainerError):
    """Another attempt moved latest.json: this writer lost the race and must stop."""

    outcome = Outcome.SUPERSEDED


class NothingCommittedError(TrainerError):
    """The script ended without training a step: no checkpoint of the run exists."""

    outcome = Outcome.NO_CHECKPOINT
