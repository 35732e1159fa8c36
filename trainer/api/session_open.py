"""Opening a `CheckpointSession`: which run it writes, the checkpoint it continues from,
the claim of the run, and a run that is already finished.

One concern of the session's (`trainer.api.session`), on the session's own state: a mixin
of `CheckpointSession`, never used on its own.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any

from ..base import rng_identity, strict_json
from ..base.errors import (
    AlreadyExistsError,
    ConfigError,
)
from ..base.outcomes import Outcome
from ..checkpoints.dataset import check_same_data, dataset_manifest
from ..checkpoints.manifest import Manifest
from ..checkpoints.records import Lineage
from ..checkpoints.repo import CheckpointRepo
from ..checkpoints.resume import resolve_resume
from ..process.code_version import ckpt_assets_version, code_version_of
from ..process.contract import (
    RESUME_FROM_ALIAS,
    Env,
    Finished,
    LaunchEnv,
    Skipped,
    Started,
)
from ..process.exit_hooks import (
    ends_like_the_block,
)
from ..process.liveness import Heartbeat
from ..ranks.distributed import Ranks
from ..ranks.rank_watch import RankBeat
from ..ranks.sharded import ShardedParts
from ..ranks.world import env_rank
from ..storage import open_store
from .checkpointer import Checkpointer, RNGState
from .data import ResumableLoader
from .default_store import default_store, from_scratch_words
from .kept import KEPT_PART
from .parts import (
    Measured,
    as_part,
    kind_of,
)

log = logging.getLogger("trainer")


class Opening:
    """What `restore` does, and what it decides before the first step."""

    def _place(self, launched: LaunchEnv | None, run, experiment, store, dataset, data_version,
               resume, triggers: dict[str, Any]) -> None:
        """Which run this session writes, where, from what. Launched by the orchestrator,
        its run, experiment, store, dataset and attempt win over the arguments (which serve
        standalone runs), so a script cannot write into another run than its own."""
        if launched is not None:
            self.run, self.experiment = launched.run, launched.experiment
            self.store_uri = launched.store_uri or store or os.path.abspath("checkpoints")
            self.dataset = launched.dataset_uri or dataset
            self._data_version = launched.data_version or data_version
            if launched.heartbeat_seconds is not None:
                # The orchestrator judges liveness by heartbeats: its interval holds.
                triggers["heartbeat_seconds"] = launched.heartbeat_seconds
            self.resume = resume or launched.resume_from or "auto"
            return
        self.run, self.experiment = run or "run", experiment or "default"
        self.store_uri = store or os.environ.get(Env.STORE_URI) or default_store()
        self.dataset, self._data_version = dataset, data_version
        self.resume = (resume or os.environ.get(Env.RESUME_FROM)
                       or os.environ.get(RESUME_FROM_ALIAS) or "auto")

    @ends_like_the_block

    def restore(self, parts: dict[str, Any] | None = None, /, **named: Any) -> int:
        """Register the named parts, load the checkpoint to continue from (if any), and
        return the step it holds (0: start fresh)."""
        if not self._in_block:
            self._install_exit_hooks()
        if self._ck is not None:
            raise ConfigError("restore() was called twice; call it once, after every part exists")
        drawn = rng_identity.drawn()  # before the checkpoint's generators are set
        all_parts = {**(parts or {}), **named}
        sharded, wrapped = self._wrap_parts(all_parts)
        self.ranks = self._join_ranks()
        store = open_store(self.store_uri)
        store.check_reachable()
        self.repo = CheckpointRepo(store, self.experiment, self.run)
        data_version = self.data_version
        manifest, skipped, attempt = self._resume_point(data_version)
        if self._done(manifest):
            self._already_finished(manifest)
        ck = self._ck = Checkpointer(self.repo, wrapped, attempt, self.triggers.keep_last,
                                     self.triggers.keep_best, self.triggers.async_save,
                                     self.ranks, sharded)
        ck.on_commit = self._on_commit
        if manifest is not None:
            t0 = time.perf_counter()
            ck.load(manifest)
            ck.last_saved_step = manifest.step
            self._last_final = manifest.meta.get("final") is True
            self._say(f"resumed from {self.repo.uri(manifest.name)} at step {manifest.step} "
                      f"(restore {time.perf_counter() - t0:.2f}s)")
        else:
            self._say(from_scratch_words(self.store_uri, self.experiment, self.run, attempt))
        self._compare_generators(manifest, attempt, drawn)
        self.lineage = self._lineage(attempt, manifest, data_version)
        self._config_ref = self._store_config()
        self.reporter.send(Started(
            attempt, self.lineage.resumed_from_step,
            self.repo.uri(manifest.name) if manifest else None,
            [Skipped(n, r) for n, r in skipped], self.max_steps, self.lineage.to_dict()))
        self._last_save_t = time.monotonic()
        self._plan_calm_steps()
        return self.loop.step

    def _wrap_parts(self, all_parts: dict[str, Any]) -> tuple[ShardedParts | None, dict]:
        """(the fully_shard-ed parts, which go through DCP (`trainer.ranks.sharded`); every other
        part, with the loop, the generators and the kept values, each wrapped to measure its
        state as the checkpointer takes it: the record's part_bytes)."""
        sharded, unsharded = ShardedParts.split(all_parts)
        wrapped = {name: as_part(name, obj) for name, obj in unsharded.items()}
        wrapped.update(loop=self.loop, rng=RNGState())
        if self._kept is not None:
            if KEPT_PART in all_parts:
                raise ConfigError(f"checkpoint part name {KEPT_PART!r} holds the values of "
                                  "keep(); rename your part")
            wrapped[KEPT_PART] = self._kept
        self._part_kinds = {name: kind_of(obj) for name, obj in all_parts.items()}
        self._loaders = [obj for obj in all_parts.values() if isinstance(obj, ResumableLoader)]
        return sharded, {name: Measured(part, name, self._sizes_of_save)
                         for name, part in wrapped.items()}

    def _join_ranks(self) -> Ranks | None:
        """This process's place among several ranks (None: alone), its liveness beating."""
        rank, world = env_rank()
        if world > 1 and self._rank_beat is None:
            # Every rank's liveness reaches its launcher, from before the first collective.
            self._rank_beat = RankBeat(rank)
            self._rank_beat.start()
        return Ranks.detect(self.triggers.collective_timeout_s, self.triggers.async_save)

    def _resume_point(self, data_version: str | None
                      ) -> tuple[Manifest | None, list[tuple[str, str]], int]:
        """The checkpoint to continue from, the ones skipped, and this attempt's number.
        One process decides (rank 0 of several): it beats, verifies and claims the run;
        the other ranks learn its decision and read the same manifest."""
        repo = self.repo
        if self.ranks is not None and not self.ranks.leader:
            name, skipped, attempt = self.ranks.from_leader(None)
            return (repo.read_manifest(name) if name else None), skipped, attempt
        # Beats from here on, whatever the restore and each step cost: liveness is not
        # progress (trainer.process.liveness).
        self._beat = Heartbeat(repo, self.triggers.heartbeat_seconds,
                               self.launch.dagster_run_id if self.launch else None)
        self._beat.start()
        manifest, skipped = resolve_resume(repo, self.resume)
        if self._done(manifest):  # a finished run is read, never claimed (`restore`)
            if self.ranks is not None:
                self.ranks.from_leader((manifest.name, skipped, manifest.attempt))
            return manifest, skipped, manifest.attempt
        if manifest is not None:
            lineage = Lineage.from_dict(manifest.meta.get("lineage"))
            check_same_data(lineage.data_version, data_version, repo.uri(manifest.name))
        attempt = repo.claim(manifest.name if manifest else None,
                             at_least=self.launch.attempt if self.launch else 1,
                             launched=self.launch is not None)
        self._beat.claimed(attempt, manifest.step if manifest else 0)
        if self.ranks is not None:
            self.ranks.from_leader((manifest.name if manifest else None, skipped, attempt))
        return manifest, skipped, attempt

    def _lineage(self, attempt: int, resumed: Manifest | None,
                 data_version: str | None) -> Lineage:
        return Lineage(
            experiment=self.experiment, run=self.run, attempt=attempt,
            dagster_run_id=self.launch.dagster_run_id if self.launch else None,
            root_run_id=self.launch.root_run_id if self.launch else None,
            resumed_from_step=resumed.step if resumed else None,
            code_version=ckpt_assets_version(),
            user_code_version=code_version_of(self.code_path) if self.code_path else None,
            data_version=data_version, dataset=self.dataset)

    @property

    def data_version(self) -> str | None:
        """The dataset's version: given, set by the orchestrator, or from its manifest."""
        if self._data_version is None and self.dataset:
            self._data_version = dataset_manifest(self.dataset).version
        return self._data_version

    @data_version.setter

    def data_version(self, version: str | None) -> None:
        self._data_version = version

    def _store_config(self) -> dict[str, str] | None:
        """The config once per distinct content, referenced from every manifest by hash
        (a manifest stays small however large the config)."""
        if self.config is None or not self.leads:
            return None
        body = strict_json.dumps(self.config, sort_keys=True, indent=1).encode()
        sha = hashlib.sha256(body).hexdigest()
        key = f"{self.repo.prefix}/configs/{sha}.json"
        try:
            self.repo.store.put_new(key, body)
        except AlreadyExistsError:
            pass
        return {"sha256": sha, "uri": self.repo.store.uri_for(key)}

    def _done(self, manifest: Manifest | None) -> bool:
        """The checkpoint to continue from is the run's final one, and continuing past it
        was not asked for: by `continue_finished`, or by raising the run's target (a
        `max_steps` above the one it finished under: a script or config changed to train
        longer says so itself). A loop that stopped early under the same target (a loss
        low enough, early stopping) stays finished."""
        if manifest is None or manifest.meta.get("final") is not True:
            return False
        target = manifest.meta.get("max_steps")
        raised = (self.max_steps is not None and isinstance(target, int)
                  and self.max_steps > target)
        return not (self.triggers.continue_finished or raised)

    def _already_finished(self, manifest: Manifest) -> None:
        """A run that reached its final checkpoint is done: say so and end the process with
        0, whatever loop follows `restore` (an open-ended one would train past the end).
        Nothing is claimed, loaded or written."""
        self._closed = self._finishing = True
        self._stop_heartbeat()
        self.loop.step = manifest.step
        self._say(f"{self.experiment}/{self.run} already finished at step {manifest.step} "
                  f"({self.repo.uri(manifest.name)}); nothing to train. To train past its "
                  "end, pass continue_finished=True to CheckpointSession (config: "
                  "checkpoint.continue_finished: true), or start a new run")
        self.reporter.send(Finished(manifest.step, dict(manifest.meta.get("metrics") or {})))
        self.reporter.close()
        self._drop_exit_hooks()
        raise SystemExit(Outcome.SUCCESS.exit_code)

    def _compare_generators(self, manifest: Manifest | None, attempt: int,
                            drawn: set[str]) -> None:
        """Name a resumed attempt whose generators began elsewhere than the first
        attempt's (`trainer.base.rng_identity`); a fresh start is the first attempt."""
        if manifest is None:
            self._rng_first = {"attempt": attempt, "identity": self._rng_start}
            return
        first = manifest.meta.get("rng_identity", {}).get("first") or {}
        if not first.get("identity"):
            return  # written before identities were recorded: nothing to compare
        self._rng_first = first
        names = rng_identity.differing(first["identity"], self._rng_start, drawn)
        if names and self.leads:
            self.reporter.log(rng_identity.warning_for(attempt, first["attempt"], names),
                              logging.WARNING)

    def _rng_record(self) -> dict[str, Any]:
        """What each checkpoint records of the generators: this attempt's start and the
        first attempt's, which every later attempt is compared with."""
        return {"attempt": self._rng_start, "first": self._rng_first}
