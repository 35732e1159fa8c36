"""Sharded parts in one process (a process group of one, in this test process): a
fully_shard-ed model and its optimizer round-trip through the session bitwise, saved through
DCP beside the rank state; what the session cannot do with them is refused, saying what to
do. Several ranks, signals and resharding: tests/standalone/test_fsdp.py."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from tests.trainer_proc import assert_bitwise_equal
from trainer import CheckpointSession
from trainer.base.outcomes import Outcome
from trainer.ranks.dcp_storage import METADATA_FILE, read_whole, shard_file


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg"), 1), rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sharded(seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, opt, steps: int, ckpt: CheckpointSession, start: int) -> None:
    for step in range(start + 1, steps + 1):
        loss = model(torch.randn(3, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ckpt.step(step, loss=loss)


def _session(tmp_path, **kw) -> CheckpointSession:
    return CheckpointSession(run="r", store=str(tmp_path / "store"), max_steps=6,
                             every_steps=3, install_signals=False, seed=0, **kw)


@pytest.mark.parametrize("async_save", [False, True], ids=["synchronous", "background"])
def test_a_sharded_model_and_optimizer_resume_bitwise_through_dcp(tmp_path, one_rank,
                                                                   async_save):
    # Background saves copy the shards on the training thread and write them without
    # collectives; the reference trains synchronously, so both paths end in the same bits.
    model, opt = _sharded()
    first = _session(tmp_path, async_save=async_save)
    with first as ckpt:  # an attempt that ends at step 3 (max_steps 6 is never reached)
        _train(model, opt, 3, ckpt, ckpt.restore(model=model, optimizer=opt))
        ckpt.max_steps = None
    manifest = ckpt.repo.read_manifest(ckpt.repo.read_pointer().checkpoint)
    assert {METADATA_FILE, shard_file(0), "state.pt"} == set(manifest.files)
    assert set(read_whole(ckpt.repo, manifest)) == {"model", "optimizer"}

    resumed, resumed_opt = _sharded(seed=1)  # other initial weights: the checkpoint wins
    # The first attempt's end is final: continuing past it is asked for.
    with _session(tmp_path, async_save=async_save, continue_finished=True) as again:
        _train(resumed, resumed_opt, 6, again,
               again.restore(model=resumed, optimizer=resumed_opt))
    ref_model, ref_opt = _sharded()
    with _session(tmp_path / "ref") as ref:
        _train(ref_model, ref_opt, 6, ref, ref.restore(model=ref_model, optimizer=ref_opt))
    got = read_whole(again.repo, again.repo.read_manifest(again.repo.read_pointer().checkpoint))
    want = read_whole(ref.repo, ref.repo.read_manifest(ref.repo.read_pointer().checkpoint))
    assert_bitwise_equal(got, want)


@pytest.mark.parametrize(("parts", "message"), [
    (("optimizer",), "pass the fully_shard-ed model as a part too"),
])
def test_what_the_session_cannot_do_with_sharded_parts_is_refused_as_bad_input(
        tmp_path, one_rank, caplog, parts, message):
    model, opt = _sharded()
    ckpt = _session(tmp_path)
    named = {"model": model, "optimizer": opt}
    with caplog.at_level(logging.ERROR, "trainer"), pytest.raises(SystemExit) as exc, ckpt:
        ckpt.restore(**{p: named[p] for p in parts})
    assert exc.value.code == Outcome.BAD_INPUT.exit_code
    assert message in caplog.text
