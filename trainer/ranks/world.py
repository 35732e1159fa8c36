"""What a rank knows of its world without a process group: torchrun's variables, a lost
peer, and the attempt's exit status from its ranks' (the cause, not the echoes).

Light on purpose: the session, the reporter and the nodes read it; the ranks launcher
(`trainer.ranks.launch`) and everything it imports stay out of a plain script's process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..base.outcomes import STOP_SIGNALS, Outcome, signal_of

# torchrun's variables, read by the session to know its rank without a process group.
RANK_ENV = "RANK"
WORLD_SIZE_ENV = "WORLD_SIZE"
LOCAL_RANK_ENV = "LOCAL_RANK"
# A rank's own failure that only reports another's: it lost a peer, or was told to stop.
ECHOES = (Outcome.RANK_LOST, Outcome.PREEMPTED)


def env_rank(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(rank, world size) as torchrun set them for this process; (0, 1) outside torchrun."""
    try:
        return int(environ.get(RANK_ENV, 0)), int(environ.get(WORLD_SIZE_ENV, 1))
    except ValueError:
        return 0, 1


# What gloo puts in the plain RuntimeError it raises when a peer goes away or a collective
# times out (torch's own DistError subclasses, NCCL's among them, are caught by type). Only
# these: a RuntimeError that merely names a backend can be a bug, which is never resumed.
PEER_LOST_WORDS = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting")


def lost_a_peer(error: BaseException) -> bool:
    """Did a collective fail under this rank (a peer died or hung), in our code or the
    user's (DDP's backward)? Only ever asked of a process that is one of several ranks."""
    if any(c.__name__ == "DistError" for c in type(error).__mro__):
        return True
    return isinstance(error, RuntimeError) and any(w in str(error) for w in PEER_LOST_WORDS)


def attempt_exit(rank_codes: Mapping[int, int]) -> int:
    """The attempt's exit code from its failed ranks' exit statuses (rank -> Popen's code,
    -N for a signal): the cause, not the echoes (module docstring)."""
    ranks = sorted(rank_codes)
    for r in ranks:
        sig = signal_of(rank_codes[r])
        if rank_codes[r] < 0 and sig not in STOP_SIGNALS:
            return 128 + sig
    outcomes = {r: Outcome.of_exit(rank_codes[r]) for r in ranks}
    for r in ranks:
        if outcomes[r] not in ECHOES:
            code = rank_codes[r]
            return 128 + signal_of(code) if code < 0 else code
    if Outcome.RANK_LOST in outcomes.values():
        return Outcome.RANK_LOST.exit_code
    return Outcome.PREEMPTED.exit_code
