"""Error classes of the trainer, each tied to one documented exit code.

The exit code is the contract with the orchestrator's failure policy: it decides whether
a failed run is worth resuming, so every error the trainer can foresee maps to one.
"""

EXIT_OK = 0
EXIT_USER_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_CHECKPOINT_UNLOADABLE = 3
EXIT_DIVERGED = 4
EXIT_STORAGE_UNAVAILABLE = 5
EXIT_SUPERSEDED = 6
EXIT_PREEMPTED = 143

FAILURE_CLASSES = {
    EXIT_OK: "success",
    EXIT_USER_ERROR: "user_code_error",
    EXIT_BAD_INPUT: "bad_input",
    EXIT_CHECKPOINT_UNLOADABLE: "checkpoint_unloadable",
    EXIT_DIVERGED: "diverged",
    EXIT_STORAGE_UNAVAILABLE: "storage_unavailable",
    EXIT_SUPERSEDED: "superseded",
    EXIT_PREEMPTED: "preempted",
}


class TrainerError(Exception):
    """Base class: an error the trainer foresaw, with the exit code that reports it."""

    exit_code = EXIT_USER_ERROR

    @property
    def failure_class(self) -> str:
        return FAILURE_CLASSES[self.exit_code]


class ConfigError(TrainerError):
    """The config, a CLI argument or another input is wrong; retrying cannot help."""

    exit_code = EXIT_BAD_INPUT


class InvalidNameError(ConfigError):
    """An experiment, run or key name that is not allowed (it could escape the store)."""


class CheckpointError(TrainerError):
    """A checkpoint exists but cannot be used: corrupt, truncated, unsafe or incompatible."""

    exit_code = EXIT_CHECKPOINT_UNLOADABLE


class CheckpointNotFoundError(ConfigError):
    """An explicitly requested checkpoint does not exist (a wrong URI is bad input)."""


class DivergedError(TrainerError):
    """The loss became NaN or infinite."""

    exit_code = EXIT_DIVERGED


class StorageError(TrainerError):
    """The store could not be reached or answered with errors after retries."""

    exit_code = EXIT_STORAGE_UNAVAILABLE


class AlreadyExistsError(StorageError):
    """A create-once write found the name taken: never overwrite a committed object."""


class PointerConflictError(TrainerError):
    """Another attempt moved latest.json: this writer lost the race and must stop."""

    exit_code = EXIT_SUPERSEDED
