"""Example of a user task (the README shows this file in full).

Point a config at it with  "task": "trainer.tasks.regression:build".
Everything the task keeps between steps lives in `stateful` parts or in `values`, so a
resumed run continues exactly as if it had never stopped.
"""

from __future__ import annotations

import torch
from torch import nn

from ..api.task import Task, TaskArgs


class NoiseCurriculum:
    """Step-to-step state of the task's own: label noise that decays as training goes on."""

    def __init__(self, start: float):
        self.level = start

    def step(self) -> float:
        self.level *= 0.99
        return self.level

    def state_dict(self) -> dict:
        return {"level": self.level}

    def load_state_dict(self, state: dict) -> None:
        self.level = state["level"]


def build(t: TaskArgs) -> Task:
    n, dim = int(t.args.get("n", 1024)), int(t.args.get("dim", 8))
    g = torch.Generator().manual_seed(int(t.args.get("data_seed", 0)))
    true_w = torch.randn(dim, 1, generator=g)
    x = torch.randn(n, dim, generator=g)
    y = x @ true_w
    x_eval = torch.randn(256, dim, generator=g)
    y_eval = x_eval @ true_w

    model = nn.Sequential(nn.Linear(dim, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
    curriculum = NoiseCurriculum(float(t.args.get("noise", 0.5)))
    values = {"loss_ema": None}  # plain JSON values: restored into this same dict

    def loss_fn(m: nn.Module, batch) -> torch.Tensor:
        xb, yb = batch
        noisy = yb + curriculum.step() * torch.randn_like(yb)  # draws from torch's RNG
        loss = nn.functional.mse_loss(m(xb), noisy)
        ema = values["loss_ema"]
        values["loss_ema"] = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        return loss

    @torch.no_grad()
    def eval_fn(m: nn.Module) -> dict[str, float]:
        return {"loss": float(nn.functional.mse_loss(m(x_eval), y_eval))}

    return Task(model=model, train_data=list(zip(x, y, strict=True)), loss_fn=loss_fn,
                eval_fn=eval_fn, stateful={"curriculum": curriculum}, values=values)
