"""Parts whose state is sharded over the ranks: FSDP2 (`fully_shard`) modules and their
optimizers, checkpointed through DCP over the commit protocol (`trainer.ranks.dcp_storage`).

A part is sharded when its parameters are DTensors: a module after `fully_shard`, or an
optimizer over such a module's parameters. Their state is never gathered on one rank:
`get_state_dict` hands each rank its shards, DCP writes them (one object per rank, the
metadata by rank 0) into the same pending checkpoint as the rank files, and rank 0's
manifest lists them all after the save's barrier. On resume DCP reads each rank's shards
back through `set_state_dict`, at any world size (DCP reshards), verified first.

Everything else of the checkpoint stays in the rank files (`trainer.ranks.distributed`): the
loop's counters, the data position, plain dicts, each rank's RNG states. Replicated parts
are not moved to DCP: a DDP model is whole on every rank, the rank files already spread
it over the ranks and load it at any world size, and `torch.load` of a whole file is what
every other tool reads, so replicated-only runs keep their layout.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..base.errors import CheckpointError, ConfigError
from ..checkpoints.commit import Pending
from ..checkpoints.manifest import Manifest
from ..checkpoints.repo import CheckpointRepo
from .distributed import CollectiveError, Ranks
from .world import lost_a_peer

SHARDED_META = "sharded_parts"  # the manifest's meta key: the parts saved through DCP


def _is_sharded_params(params) -> bool:
    # Without importing DTensor (a second of imports for every run): a model that holds
    # DTensors was sharded by code that imported it already.
    tensor_module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(tensor_module, "DTensor", None)
    return dtensor is not None and any(isinstance(p, dtensor) for p in params)


def _optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


class Shards(NamedTuple):
    """One rank's sharded state taken for a save, and every part's whole size in bytes."""
    state: dict[str, Any]
    sizes: dict[str, int]


class ShardedParts:
    """The sharded modules and optimizers of a session, saved and loaded as one DCP state."""

    def __init__(self, modules: dict[str, torch.nn.Module],
                 optimizers: dict[str, tuple[torch.optim.Optimizer, torch.nn.Module]]):
        self.modules = modules
        self.optimizers = optimizers  # name -> (optimizer, the module it steps)

    @classmethod
    def split(cls, parts: dict[str, Any]) -> tuple[ShardedParts | None, dict[str, Any]]:
        """(the sharded parts, or None; the other parts, checkpointed as before)."""
        modules = {n: p for n, p in parts.items() if isinstance(p, torch.nn.Module)
                   and _is_sharded_params(p.parameters())}
        opts = {n: p for n, p in parts.items() if isinstance(p, torch.optim.Optimizer)
                and _is_sharded_params(_optimizer_params(p))}
        if not modules and not opts:
            return None, parts
        paired = {n: (opt, cls._module_of(n, opt, modules)) for n, opt in opts.items()}
        rest = {n: p for n, p in parts.items() if n not in modules and n not in opts}
        return cls(modules, paired), rest

    @staticmethod
    def _module_of(name: str, opt: torch.optim.Optimizer,
                   modules: dict[str, torch.nn.Module]) -> torch.nn.Module:
        """The sharded module whose parameters `opt` steps: DCP keys its state by their names."""
        mine = {id(p) for p in _optimizer_params(opt)}
        for module in modules.values():
            if mine <= {id(p) for p in module.parameters()}:
                return module
        raise ConfigError(
            f"optimizer {name!r} steps sharded (fully_shard-ed) parameters, but no single "
            "part passed to restore() holds all of them; pass the fully_shard-ed model as a "
            "part too (its state is keyed by the model's parameter names)")

    @property
    def names(self) -> list[str]:
        return sorted([*self.modules, *self.optimizers])

    def state_dict(self) -> dict[str, Any]:
        """Each part's shards on this rank, keyed by parameter names (DCP's layout)."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        state: dict[str, Any] = {n: get_model_state_dict(m) for n, m in self.modules.items()}
        for n, (opt, module) in self.optimizers.items():
            state[n] = get_optimizer_state_dict(module, opt)
        return state

    def sizes(self) -> dict[str, int]:
        """Bytes of each part's whole state (over all ranks): the manifest's part_bytes."""
        out = {n: sum(_global_bytes(t) for t in m.state_dict().values())
               for n, m in self.modules.items()}
        for n, (opt, _) in self.optimizers.items():
            out[n] = sum(_global_bytes(t) for s in opt.state.values() for t in s.values())
        return out

    def snapshot(self) -> dict[str, Any]:
        """This rank's shards copied now (the training thread), for a background write."""
        from torch.utils._pytree import tree_map

        return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t,
                        self.state_dict())

    def write(self, repo: CheckpointRepo, pending: Pending, ranks: Ranks | None,
              state: dict[str, Any], background: bool = False) -> None:
        """Every rank's shards (`state`, from `state_dict` or `snapshot`) into `pending` (a
        collective: every rank calls it at the same step). `ranks`: the session's ranks,
        None for a single process. `background`: on a save's own thread, whose collectives
        go over a group of their own (`Ranks.saves_on`); a single rank's then run none, as
        the training thread may be using the default group."""
        from torch.distributed.checkpoint.state_dict_saver import save

        from .dcp_storage import StoreWriter

        with _dcp_errors("the sharded save", ranks):
            save(state, storage_writer=StoreWriter(repo, pending),
                 process_group=ranks.saves_on if ranks is not None else None,
                 no_dist=_alone(ranks) or (background and ranks is None))

    def read(self, repo: CheckpointRepo, manifest: Manifest, ranks: Ranks | None) -> None:
        """Load this rank's shards from `manifest`'s checkpoint, resharded to this world
        size (a collective, like `write`)."""
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )
        from torch.distributed.checkpoint.state_dict_loader import load

        from .dcp_storage import SafeLoadPlanner, StoreReader

        saved = manifest.meta.get(SHARDED_META)
        if isinstance(saved, list) and sorted(saved) != self.names:
            raise CheckpointError(
                f"checkpoint {repo.uri(manifest.name)} holds sharded parts {sorted(saved)}, "
                f"this script shards {self.names}; resume with the parts the run was "
                "started with, or start a new run")
        reader = StoreReader(repo, manifest)
        reader.read_metadata()  # verified by every rank before DCP's collectives
        state = self.state_dict()
        with _dcp_errors("the sharded load", ranks):
            load(state, storage_reader=reader, planner=SafeLoadPlanner(),
                 process_group=_group(ranks), no_dist=_alone(ranks))
        for n, m in self.modules.items():
            set_model_state_dict(m, state[n])
        for n, (opt, module) in self.optimizers.items():
            set_optimizer_state_dict(module, opt, state[n])


def _group(ranks: Ranks | None) -> Any | None:
    return ranks.group if ranks is not None else None


def _alone(ranks: Ranks | None) -> bool:
    """No process group at all: DCP runs without collectives. (A world of one that has a
    group runs DCP on it, which costs nothing and spares DCP's warning.)"""
    return ranks is None and not (dist.is_available() and dist.is_initialized())


@contextmanager
def _dcp_errors(what: str, ranks: Ranks | None) -> Iterator[None]:
    """DCP's errors as the trainer's: the cause of a failure on any rank
    (`trainer.ranks.dcp_storage.the_cause`); a collective that lost a peer is a lost rank."""
    from .dcp_storage import the_cause

    try:
        with the_cause(ranks.rank if ranks is not None else 0):
            yield
    except (RuntimeError, dist.DistError) as e:
        if ranks is not None and lost_a_peer(e):
            raise _lost(what, ranks, e) from e
        raise


def _lost(what: str, ranks: Ranks, e: BaseException) -> CollectiveError:
    return CollectiveError(
        f"rank {ranks.rank} of {ranks.world}: {what} failed ({str(e).splitlines()[0]}): a "
        "peer rank died or hung past checkpoint.collective_timeout_s. The attempt stops "
        "without committing; it resumes from the newest checkpoint")


def _global_bytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
