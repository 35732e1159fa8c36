"""Two spirals: a small MLP learns to tell two interleaved spirals apart.

An ordinary single-file PyTorch training script: argparse, data drawn from torch's seeded
generator, a hand-rolled batch loop over a fresh permutation every epoch, AdamW with
gradient clipping, an evaluation at the end of every epoch that drives ReduceLROnPlateau,
and the weights saved at the end. `original.py` is the script as it was written; `train.py`
is the same script made crash-safe and auto-resuming, and `diff original.py train.py` shows
every line that took.

    python examples/no_block/train.py --epochs 6
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from ckpt_trainer import CheckpointSession


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="two spirals, an MLP, a hand-rolled batch loop")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--n-train", type=int, default=2048, help="training points (both spirals)")
    p.add_argument("--n-val", type=int, default=512, help="validation points")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=1e-4)
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    p.add_argument("--noise", type=float, default=0.25, help="jitter added to each point")
    p.add_argument("--patience", type=int, default=0,
                   help="epochs without improvement before the LR is halved")
    p.add_argument("--log-every", type=int, default=16, help="print the loss every N batches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="where to save the final weights")
    return p.parse_args()


def spirals(n: int, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    """n points, half on each of two interleaved spirals, labelled 0 and 1."""
    half = n // 2
    t = torch.sqrt(torch.rand(half)) * 3 * math.pi  # denser towards the centre
    arm = torch.stack([t * torch.cos(t), t * torch.sin(t)], dim=1) / (3 * math.pi)
    x = torch.cat([arm, -arm]) + noise * torch.randn(2 * half, 2) / 3
    y = torch.cat([torch.zeros(half), torch.ones(half)]).long()
    return x, y


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2, hidden), nn.SiLU(),
            nn.Linear(hidden, hidden), nn.SiLU(),
            nn.Dropout(0.1),
            nn.Linear(hidden, hidden), nn.SiLU(),
            nn.Linear(hidden, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    model.eval()
    logits = model(x)
    model.train()
    return {"loss": F.cross_entropy(logits, y).item(),
            "accuracy": (logits.argmax(1) == y).float().mean().item()}


def describe(model: nn.Module) -> str:
    params = sum(p.numel() for p in model.parameters())
    return f"{type(model).__name__} with {params} parameters"


@torch.no_grad()
def confusion(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """2 x 2 counts: rows the true spiral, columns the predicted one."""
    model.eval()
    pred = model(x).argmax(1)
    model.train()
    counts = torch.zeros(2, 2, dtype=torch.long)
    counts.index_put_((y, pred), torch.ones_like(y), accumulate=True)
    return counts


def report(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    counts = confusion(model, x, y)
    for true in range(2):
        row = "  ".join(f"{int(c):5d}" for c in counts[true])
        print(f"  spiral {true}: predicted as 0 / 1: {row}", flush=True)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)

    x_train, y_train = spirals(args.n_train, args.noise)
    x_val, y_val = spirals(args.n_val, args.noise)
    batches_per_epoch = len(x_train) // args.batch_size  # the last partial batch is dropped

    model = MLP(args.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr,
                                  weight_decay=args.weight_decay)
    # Halve the LR when the validation loss stops improving: one decision per epoch.
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5,
                                                           patience=args.patience)
    print(f"{describe(model)}; {args.epochs} epochs of {batches_per_epoch} batches", flush=True)
    ckpt = CheckpointSession(experiment="spirals", run="spirals", every_steps=10,
                             max_steps=args.epochs * batches_per_epoch, seed=args.seed)
    ckpt.restore(model=model, optimizer=optimizer, scheduler=scheduler)

    t0 = time.time()
    for epoch in ckpt.epochs(args.epochs, batches_per_epoch):
        perm = torch.randperm(len(x_train))  # a new order every epoch
        model.train()
        for b in ckpt.batches():
            idx = perm[b * args.batch_size:(b + 1) * args.batch_size]
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            optimizer.step()
            ckpt.step(loss=loss)
            if (b + 1) % args.log_every == 0:
                print(f"  epoch {epoch} batch {b + 1}/{batches_per_epoch}: loss {loss.item():.4f}",
                      flush=True)
        val = evaluate(model, x_val, y_val)
        scheduler.step(val["loss"])
        print(f"epoch {epoch}: val loss {val['loss']:.4f} accuracy {val['accuracy']:.3f} "
              f"lr {optimizer.param_groups[0]['lr']:.2e}", flush=True)

    print(f"done in {time.time() - t0:.1f}s; validation set:", flush=True)
    report(model, x_val, y_val)
    if args.out:
        torch.save(model.state_dict(), args.out)
        print(f"weights saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
