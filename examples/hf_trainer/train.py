"""A Hugging Face Trainer script: a two-layer GPT-2 built from a config (nothing is
downloaded) learns a synthetic token language. `original.py` is the script as its users
write it; `train.py` the same, crash-safe and auto-resuming (README.md).
"""

import argparse
import logging

import torch
from ckpt_trainer.integrations.hf import train
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

p = argparse.ArgumentParser(description="a tiny GPT-2 under the Hugging Face Trainer")
p.add_argument("--steps", type=int, default=60)
p.add_argument("--output-dir", default="hf-out")
p.add_argument("--log-level", default="INFO")
args = p.parse_args()
logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
torch.set_num_threads(1)


class Tokens(torch.utils.data.Dataset):
    """Sequences whose next token is the previous one plus a fixed stride, mod the vocabulary."""

    def __init__(self, n: int, length: int = 16, vocab: int = 64):
        g = torch.Generator().manual_seed(1)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + stride * torch.arange(length)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


set_seed(0)
config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
model = GPT2LMHeadModel(config)
training = TrainingArguments(
    output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=8,
    learning_rate=3e-3, warmup_steps=5, logging_steps=1, save_steps=15, seed=0,
    report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
trainer = Trainer(model=model, args=training, train_dataset=Tokens(256))
train(trainer, run="tiny-gpt2", experiment="hf")
