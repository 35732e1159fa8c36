"""A Lightning script: an MLP with dropout learns a noisy sine, with Lightning's own
checkpoints every 15 steps. `original.py` is the script as its users write it; `train.py`
the same, crash-safe and auto-resuming (README.md).
"""

import argparse
import logging

import lightning.pytorch as pl
import torch
from ckpt_trainer.integrations.lightning import fit
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

p = argparse.ArgumentParser(description="an MLP under the Lightning Trainer")
p.add_argument("--steps", type=int, default=60)
p.add_argument("--root-dir", default="lightning-out")
p.add_argument("--log-level", default="INFO")
args = p.parse_args()
logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
torch.set_num_threads(1)
pl.seed_everything(0)


class Sine(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
        return [opt], [{"scheduler": sched, "interval": "step"}]


x = torch.linspace(-3, 3, 600).unsqueeze(1)
data = torch.utils.data.TensorDataset(x, torch.sin(2 * x) + 0.2 * torch.randn_like(x))
loader = StatefulDataLoader(data, batch_size=32, shuffle=True, drop_last=True)
trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", default_root_dir=args.root_dir,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[ModelCheckpoint(every_n_train_steps=15, save_top_k=-1)])
fit(trainer, Sine(), loader, session=dict(run="sine", experiment="lightning"))
