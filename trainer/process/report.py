"""Where the trainer reports progress, committed checkpoints and its failure.

Standalone, reports are log lines. Under Dagster Pipes (DAGSTER_PIPES_CONTEXT set by the
orchestrator) they are also Pipes custom messages; only the small `dagster_pipes` package
is used, never `dagster` itself. One reporter per process (`Reporter.shared()`), because a
Pipes session can be opened only once.

The orchestrator's injected params say how Pipes travels (`trainer.process.contract.PipesS3Params`):
by default through files it can read, or, for a trainer on another machine, through S3 (the
context read from an object, messages uploaded in chunks), with a client built from the
standard AWS environment like the checkpoint store's (`trainer.storage.s3.default_client`).
"""

from __future__ import annotations

import atexit
import logging
import os
import traceback

from dagster_pipes import DAGSTER_PIPES_CONTEXT_ENV_VAR

from ..base.errors import TrainerError
from ..base.outcomes import Outcome
from ..ranks.world import env_rank, lost_a_peer
from .contract import Failed, Message, PipesS3Params, to_message

log = logging.getLogger("trainer")


class Reporter:
    _shared: Reporter | None = None

    def __init__(self) -> None:
        self._pipes = None
        self._pipes_cm = None
        self._closed = False
        # Several ranks: rank 0 alone speaks to the orchestrator (a Pipes session is one
        # writer's), and its reports stand for the attempt.
        if os.environ.get(DAGSTER_PIPES_CONTEXT_ENV_VAR) and env_rank()[0] == 0:
            from dagster_pipes import open_dagster_pipes

            self._pipes_cm = open_dagster_pipes(**pipes_channels())
            self._pipes = self._pipes_cm.__enter__()

    @classmethod
    def shared(cls) -> Reporter:
        if cls._shared is None or cls._shared._closed:
            cls._shared = cls()
            atexit.register(cls._shared.close)
        return cls._shared

    def send(self, message: Message) -> None:
        """One message of the contract (`trainer.process.contract`) to the orchestrator, if any."""
        if self._pipes is not None:
            self._pipes.report_custom_message(to_message(message))

    def log(self, msg: str, level: int = logging.INFO) -> None:
        log.log(level, msg)
        if self._pipes is not None:
            self._pipes.log.log(level, msg)

    def close(self, error: BaseException | None = None) -> None:
        self._closed = True
        if self._pipes_cm is not None:
            self._pipes_cm.__exit__(type(error) if error else None, error, None)
            self._pipes_cm = self._pipes = None


def pipes_channels() -> dict:
    """The context loader and message writer the orchestrator's params ask for (none for
    Pipes' defaults)."""
    from dagster_pipes import PipesEnvVarParamsLoader

    loader = PipesEnvVarParamsLoader()
    on_context = PipesS3Params.from_params(loader.load_context_params())
    on_messages = PipesS3Params.from_params(loader.load_messages_params())
    if on_context is None and on_messages is None:
        return {}
    from dagster_pipes import PipesS3ContextLoader, PipesS3MessageWriter

    from ..storage.s3 import default_client

    client = default_client()
    out: dict = {}
    if on_context is not None:
        out["context_loader"] = PipesS3ContextLoader(client)
    if on_messages is not None:
        out["message_writer"] = PipesS3MessageWriter(client,
                                                     interval=on_messages.interval_seconds)
    return out


def report_failure(error: BaseException, reporter: Reporter) -> int:
    """Log `error` once, report it as the attempt's failure, and return its exit code.

    A foreseen error (TrainerError) is one line that says what to do; anything else is a
    bug in training code and keeps its traceback."""
    outcome = error.outcome if isinstance(error, TrainerError) else Outcome.USER_CODE_ERROR
    if outcome is Outcome.USER_CODE_ERROR and env_rank()[1] > 1 and lost_a_peer(error):
        # An echo of another rank's end: the launcher's exit status names the cause.
        outcome = Outcome.RANK_LOST
    tb = None if isinstance(error, TrainerError) else "".join(traceback.format_exception(error))
    if tb is None:
        log.error("%s: %s", outcome.value, error)
    else:
        log.error("error in training code:\n%s", tb)
    reporter.send(Failed(outcome.exit_code, outcome.value, type(error).__name__, str(error), tb))
    return outcome.exit_code
