"""The ranks of a multi-rank attempt, as one checkpoint session sees them.

Every rank runs the same loop and calls the same session; the session keeps them one
attempt with three collectives on a gloo group of its own (so a job on NCCL checkpoints
the same way), each bounded by `checkpoint.collective_timeout_s`:

* `from_leader`: rank 0 alone finds the checkpoint to continue from, verifies it and claims
  the run; every rank learns the name and the attempt from it;
* `agree`: once per step, any rank's stop request, due save or fencing is every rank's, so
  all ranks commit the same step and stop together;
* `to_leader`: after each rank's files of a checkpoint are durable, their entries reach
  rank 0, which alone writes the manifest (the commit marker) and moves the pointer.

A collective that fails (a peer died) or times out (a peer hung) is `CollectiveError`:
the attempt fails once as `rank_lost` and is resumed. The rank then ends at once
(`trainer.process.exit_hooks.exit_now`): at a normal exit the broken group's C++ destructors can
call std::terminate (gloo's threads are still joinable), and the SIGABRT would replace the
`rank_lost` status the launcher reads.

Which state each rank writes: parts hold the same state on every rank (DDP's replicated
model and optimizer, the global data position) and are spread over the ranks' files, one
part per rank in turn, so the ranks write in parallel; the RNG states differ per rank and
each rank saves its own. At another world size the RNG streams are re-derived from the run,
the step and the rank (`rederive_rngs`), the rest loads unchanged.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..base.errors import ConfigError, TrainerError
from ..base.outcomes import Outcome
from .world import WORLD_SIZE_ENV, env_rank

RNG_PART = "rng"  # the one part every rank saves for itself


class CollectiveError(TrainerError):
    outcome = Outcome.RANK_LOST


def rank_file(rank: int) -> str:
    return f"state-rank{rank}.pt"


@dataclass
class Ranks:
    rank: int
    world: int
    group: Any  # the session's own gloo process group
    save_group: Any = None  # a background save's collectives (async_save): a group of their own

    @classmethod
    def detect(cls, timeout_s: float, async_save: bool = False) -> Ranks | None:
        """This process's place among the ranks (None: a single-rank run). Call on every
        rank at the same point: the group is created collectively."""
        initialized = dist.is_available() and dist.is_initialized()
        if not initialized:
            _, world = env_rank()
            if world > 1:
                raise ConfigError(
                    f"{WORLD_SIZE_ENV}={world} but no process group exists: call "
                    "torch.distributed.init_process_group() before CheckpointSession.restore(), "
                    "or every rank would claim the run for itself")
            return None
        if dist.get_world_size() == 1:
            return None
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        save = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) \
            if async_save else None
        return cls(dist.get_rank(), dist.get_world_size(), group, save)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def alive(self) -> bool:
        """The process group still exists: a script destroys it after its loop, and with it
        the session's own group."""
        return dist.is_initialized()

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag true on any rank, on every rank."""
        t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        with self._collective("the per-step agreement"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(bool(x) for x in t.tolist())

    def from_leader(self, obj: Any) -> Any:
        box = [obj if self.leader else None]
        with self._collective("rank 0's resume decision"):
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0),
                                       group=self.group)
        return box[0]

    @property
    def saves_on(self) -> Any:
        return self.save_group if self.save_group is not None else self.group

    def to_leader(self, obj: Any, group: Any = None) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (None elsewhere); also the barrier of a save."""
        group = group if group is not None else self.group
        out = [None] * self.world if self.leader else None
        with self._collective("the checkpoint barrier"):
            dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0), group=group)
        return out

    def owns(self, index: int) -> bool:
        """Does this rank write the `index`-th replicated part?"""
        return index % self.world == self.rank

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            raise CollectiveError(
                f"rank {self.rank} of {self.world}: {what} failed ({str(e).splitlines()[0]}): "
                "a peer rank died or hung past checkpoint.collective_timeout_s. The attempt "
                "stops without committing; it resumes from the newest checkpoint") from e


def rederive_rngs(run: str, step: int, rank: int) -> None:
    """Seed Python, NumPy and torch for `rank` of a resume at another world size: a pure
    function of the run, the step and the rank, so two such resumes draw the same."""
    digest = hashlib.sha256(f"{run}/{step}/{rank}".encode()).digest()
    seed = int.from_bytes(digest[:8], "little")
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
