"""Several real ranks of the trainer, for tests/standalone/test_ranks.py and tests/e2e/test_ranks_dagster.py.

`start_torchrun` starts `python -m trainer.ranks` (torchrun underneath) the way the
orchestrator does; `start_direct` starts the rank processes itself with torchrun's
variables (quicker: no agent), for tests that are about the commit protocol, not torchrun.
`rank_pids` finds a launcher's ranks by their RANK variable, and `wait_for_step` watches the
store's pointer, so a test kills a rank at a checkpoint it chose.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.polling import pid_alive, wait_for
from tests.ports import free_port
from tests.trainer_proc import ROOT
from trainer.ranks.world import LOCAL_RANK_ENV, RANK_ENV, WORLD_SIZE_ENV

SLOW_STEPS = str(ROOT / "tests" / "slow_steps.py")


def env(step_delay: float, **extra: str) -> dict[str, str]:
    # Unbuffered: the ranks' lines reach a shared log file in the order they happen.
    return {**os.environ, "PYTHONPATH": str(ROOT), "STEP_DELAY": str(step_delay),
            "PYTHONUNBUFFERED": "1", **extra}


def trainer_argv(config: Path, store: str) -> list[str]:
    """`python -m trainer` with each step slowed by $STEP_DELAY (a kill lands mid-run)."""
    return [sys.executable, SLOW_STEPS, "-m", "trainer", "--config", str(config),
            "--store", store]


def start_torchrun(argv: list[str], nproc: int, environ: dict[str, str],
                   log: Path, *launcher_args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "trainer.ranks", "--nproc-per-node", str(nproc),
         "--grace-seconds", "60", *launcher_args, "--", *argv],
        cwd=ROOT, env=environ, stdout=log.open("a"), stderr=subprocess.STDOUT)


def one_attempt(argv: list[str], nproc: int, log: Path, step_delay: float = 0,
                kill=None) -> int:
    """One attempt of `argv` on `nproc` ranks under the launcher; `kill(launcher, ranks)`
    once they run. The launcher's exit status."""
    launcher = start_torchrun(argv, nproc, env(step_delay), log)
    try:
        if kill is not None:
            kill(launcher, rank_pids(launcher, nproc))
        return launcher.wait(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()


def start_direct(argv: list[str], nproc: int, environ: dict[str, str],
                 log: Path) -> list[subprocess.Popen]:
    port = str(free_port())
    return [subprocess.Popen(
        argv, cwd=ROOT, stdout=log.open("a"), stderr=subprocess.STDOUT,
        env={**environ, RANK_ENV: str(r), LOCAL_RANK_ENV: str(r), WORLD_SIZE_ENV: str(nproc),
             "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        for r in range(nproc)]


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        key, _, value = item.partition(b"=")
        if key == RANK_ENV.encode():
            return int(value)
    return None


def ranks_under(launcher_pid: int) -> dict[int, int]:
    """rank -> pid of the rank processes a launcher (torchrun) runs now."""
    return {r: pid for pid in children(launcher_pid) if (r := _rank_of(pid)) is not None}


def rank_pids(launcher: subprocess.Popen, nproc: int, timeout: float = 300) -> dict[int, int]:
    """rank -> pid of the launcher's rank processes, once all of them run."""
    def found() -> dict[int, int] | None:
        ranks = ranks_under(launcher.pid)
        return ranks if len(ranks) == nproc else None
    return wait_for(found, timeout, what=f"{nproc} ranks under the launcher")


def pointer_step(store: Path, experiment: str, run: str) -> int:
    latest = store / experiment / run / "checkpoints" / "latest.json"
    try:
        return json.loads(latest.read_text()).get("step") or 0
    except (OSError, ValueError):
        return 0


def wait_for_step(store: Path, experiment: str, run: str, step: int,
                  alive: subprocess.Popen, timeout: float = 240) -> int:
    """The pointer's step once it reaches `step` (the run must still be going)."""
    def reached() -> int | None:
        assert alive.poll() is None, f"the run ended (exit {alive.returncode}) before step {step}"
        now = pointer_step(store, experiment, run)
        return now if now >= step else None
    return wait_for(reached, timeout, what=f"a checkpoint at step {step} or later")


def gone(pids: list[int], timeout: float = 300) -> None:
    """Wait until none of `pids` runs (orphaned ranks are reaped by init, not by us)."""
    wait_for(lambda: not any(map(pid_alive, pids)), timeout, what=f"processes {pids} to exit")


def sharded_final(store: Path, experiment: str, run: str) -> tuple[dict, list[dict]]:
    """The newest checkpoint's sharded state (DCP shards read back as whole tensors) and
    each rank's own file (or the one file of a one-rank checkpoint)."""
    import torch

    from trainer.checkpoints.repo import CheckpointRepo
    from trainer.ranks.dcp_storage import read_whole
    from trainer.storage import open_store

    repo = CheckpointRepo(open_store(str(store)), experiment, run)
    manifest = repo.verify(repo.read_pointer().checkpoint)
    ckdir = store / repo.key(manifest.name)
    ranks = [torch.load(ckdir / f, weights_only=True) for f in state_files(manifest)]
    return read_whole(repo, manifest), ranks


def state_files(manifest) -> list[str]:
    """The files of a checkpoint's state besides its shards: one per rank, or one alone."""
    from trainer.api.state_files import STATE_FILE
    from trainer.ranks.distributed import rank_file

    world = manifest.meta.get("world_size")
    return [rank_file(r) for r in range(world)] if world else [STATE_FILE]

