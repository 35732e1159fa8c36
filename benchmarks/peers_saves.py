"""The three ways of saving that `bench_peers.py` (a) puts side by side, and its step loop.

Each way sees the same loop: steps 1..5 warm up, then per save 5 normal steps, the step
that saves, and 5 steps after it; the checkpoint must be durable before the next round.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

WARM, BEFORE, AFTER, SAVES = 5, 5, 5, 3
EVERY = BEFORE + 1 + AFTER  # our step trigger: the save step of every round


@dataclass
class SaveFigures:
    stall: float  # seconds the save call held the training thread
    normal: float  # median of the steps before the save
    after_mean: float  # the steps after the save, over `normal`
    after_worst: float
    durable: float  # seconds from the save call to the checkpoint being durable


@dataclass
class Result:
    saves: list[SaveFigures] = field(default_factory=list)

    def steady(self) -> SaveFigures:
        """The median of each figure over the saves after the first (which allocates)."""
        later = self.saves[1:] or self.saves
        return SaveFigures(*(statistics.median(getattr(s, f) for s in later)
                             for f in SaveFigures.__dataclass_fields__))


class Ours:
    """`CheckpointSession(async_save=True)`: the save fires inside `ckpt.step(loss=...)`."""

    def open(self, model, opt, work: Path) -> None:
        from trainer import CheckpointSession
        from trainer.checkpoints.repo import CheckpointRepo
        from trainer.storage import open_store

        self.ckpt = CheckpointSession(run="peers", store=str(work), resume="never",
                                      async_save=True, every_steps=EVERY)
        self.ckpt.restore(model=model, optimizer=opt)
        self.repo = CheckpointRepo(open_store(str(work)), "default", "peers")
        self.calls: list[float] = []

    def before_opt_step(self) -> None:
        """Nothing: the session's own fence (an optimizer pre-hook) waits for its copy."""

    def end_step(self, step: int, loss, save: bool) -> float:
        t0 = time.perf_counter()
        self.ckpt.step(step, loss=loss)
        dt = time.perf_counter() - t0
        if not save:
            self.calls.append(dt)
            return dt
        # Watched from now, on a thread: the commit may land during the steps after it.
        self.durable_at: float | None = None
        threading.Thread(target=self._watch, args=(step,), daemon=True).start()
        # The save is what this call cost beyond a step call's usual cost.
        return dt - statistics.median(self.calls)

    def _watch(self, step: int) -> None:
        def committed() -> bool:
            ptr = self.repo.read_pointer()
            return ptr is not None and ptr.step is not None and ptr.step >= step
        self.durable_at = _poll(committed)

    def durable_after(self, step: int, t_save: float) -> float:
        return _poll(lambda: self.durable_at is not None, at=lambda: self.durable_at) - t_save

    def close(self) -> None:
        self.ckpt.close()


class DCP:
    """`torch.distributed.checkpoint.async_save` with a `DefaultStager` kept across saves."""

    def open(self, model, opt, work: Path) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda,
                                                   use_shared_memory=False,
                                                   use_async_staging=True,
                                                   use_non_blocking_copy=cuda))
        self.model, self.opt, self.work = model, opt, work
        self.response = self.staging = None
        self.done_at: float | None = None

    def before_opt_step(self) -> None:
        if self.staging is not None:  # the step's write must not tear the snapshot
            self.staging.result()
            self.staging = None

    def end_step(self, step: int, loss, save: bool) -> float:
        if not save:
            return 0.0
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t0 = time.perf_counter()
        msd, osd = get_state_dict(self.model, self.opt)
        self.response = dcp.async_save({"model": msd, "optim": osd},
                                       checkpoint_id=str(self.work / f"step-{step}"),
                                       async_stager=self.stager)
        stall = time.perf_counter() - t0
        self.staging, self.done_at = self.response.staging_completion, None
        self.response.upload_completion.add_done_callback(self._done)
        return stall

    def _done(self, _future) -> None:
        self.done_at = time.perf_counter()

    def durable_after(self, step: int, t_save: float) -> float:
        self.response.upload_completion.result()
        return _poll(lambda: self.done_at is not None, at=lambda: self.done_at) - t_save

    def close(self) -> None:
        self.stager.close()


class TorchSave:
    """`torch.save` of the live state to one file, then fsync: durable when it returns."""

    def open(self, model, opt, work: Path) -> None:
        self.model, self.opt, self.work = model, opt, work

    def before_opt_step(self) -> None:
        pass

    def end_step(self, step: int, loss, save: bool) -> float:
        if not save:
            return 0.0
        t0 = time.perf_counter()
        with open(self.work / f"step-{step}.pt", "wb") as f:
            torch.save({"model": self.model.state_dict(), "optim": self.opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        return time.perf_counter() - t0

    def durable_after(self, step: int, t_save: float) -> float:
        return 0.0  # the stall is the time to durable

    def close(self) -> None:
        pass


SAVERS = {"ours": Ours(), "DCP": DCP(), "torch.save": TorchSave()}


def _poll(done, at=time.perf_counter, every: float = 0.01, timeout: float = 600) -> float:
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() > end:
            raise TimeoutError("the checkpoint did not become durable in 10 minutes")
        time.sleep(every)
    return at()


def measure(saver, model, opt, x, work: Path) -> Result:
    """The loop above: per save, (stall, steps after / normal, durable)."""
    def train() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        saver.before_opt_step()
        opt.step()
        return loss

    def timed_step(step: int, save: bool = False) -> tuple[float, float, float]:
        """(whole step, the saver's part, when it started)."""
        t0 = time.perf_counter()
        loss = train()
        t1 = time.perf_counter()
        part = saver.end_step(step, loss, save)
        return time.perf_counter() - t0, part, t1

    saver.open(model, opt, work)
    result, step = Result(), 0
    try:
        for _ in range(WARM):
            step += 1
            timed_step(step)
        for _ in range(SAVES):
            normal = [timed_step(step := step + 1)[0] for _ in range(BEFORE)]
            _, stall, t_save = timed_step(step := step + 1, save=True)
            save_step = step
            after = [timed_step(step := step + 1)[0] for _ in range(AFTER)]
            durable = saver.durable_after(save_step, t_save)
            base = statistics.median(normal)
            result.saves.append(SaveFigures(stall, base, statistics.mean(after) / base,
                                            max(after) / base, max(durable, stall)))
    finally:
        saver.close()
    return result
