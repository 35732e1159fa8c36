"""A small transformer language model sharded with FSDP2 (`fully_shard`), crash-safe as one job.

Every rank runs this script. Its model and optimizer are sharded: no rank holds all of
their state, so the session saves them through `torch.distributed.checkpoint` (each rank
writes its own shards into the checkpoint, rank 0 commits once all are durable) and loads
them back at any world size, resharded: two ranks can resume one rank's checkpoint and the
other way round. The data position, the loop's counters and each rank's RNG states go in
the ranks' own files as with DDP. The lines marked `# ckpt` are all it takes.

    python -m trainer.ranks --nproc-per-node 2 -- \\
        python examples/fsdp/fsdp_transformer.py --store /tmp/ckpts --run fsdp-1 --steps 200

(`torchrun --nproc-per-node 2 examples/fsdp/fsdp_transformer.py ...` works too; one rank is
`--nproc-per-node 1`.) The batch is global: each rank trains on its slice of it, so a
resume at another world size continues at the same sample.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from ckpt_trainer import CheckpointSession, ResumableLoader  # ckpt

VOCAB, CONTEXT = 32, 16


class TinyTransformer(nn.Module):
    """A decoder-only transformer: token and position embeddings, causal blocks, a head."""

    def __init__(self, dim: int = 32, heads: int = 2, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(CONTEXT, dim) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.1, batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of every position, as (batch * positions, VOCAB)."""
        h = self.embed(x) + self.pos[: x.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        # Flat before the head: its output is then a tensor of its own, not a view (FSDP2
        # warns of views, whose in-place changes would skip its backward hook).
        return self.head(self.norm(h).reshape(-1, h.shape[-1]))


class Windows(torch.utils.data.Dataset):
    """Windows of a token stream with structure to learn: each token mostly follows from the
    one before, with seeded noise (the same stream on every rank and every attempt)."""

    def __init__(self, tokens: int = 8192, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        noise = torch.randint(0, VOCAB, (tokens,), generator=g)
        keep = torch.rand(tokens, generator=g) < 0.8
        stream = torch.empty(tokens, dtype=torch.long)
        stream[0] = 0
        for t in range(1, tokens):
            stream[t] = (stream[t - 1] * 5 + 3) % VOCAB if keep[t] else noise[t]
        self.stream = stream

    def __len__(self) -> int:
        return (len(self.stream) - 1) // CONTEXT

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.stream[i * CONTEXT: (i + 1) * CONTEXT + 1]


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The sharded model and its optimizer; the same initial weights on every rank."""
    torch.manual_seed(seed)
    model = TinyTransformer()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--store", default="checkpoints")
    p.add_argument("--run", default="fsdp")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    p.add_argument("--batch-size", type=int, default=16, help="global, over all ranks")
    p.add_argument("--async-save", action="store_true", help="commit in the background")
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = CheckpointSession(run=args.run, experiment="fsdp", store=args.store, seed=0,  # ckpt
                             max_steps=args.steps, every_steps=args.every,  # ckpt
                             async_save=args.async_save)  # ckpt
    model, opt = build()
    loader = ResumableLoader(Windows(), args.batch_size, seed=0, rank=rank, world=world)

    start = ckpt.restore(model=model, optimizer=opt, data=loader)  # ckpt
    batches = loader.batches()
    for step in range(start + 1, args.steps + 1):
        window = next(batches)
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits, window[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()  # the global batch's loss, the same on every rank
        dist.all_reduce(mean)
        ckpt.step(step, loss=mean / world)  # ckpt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
