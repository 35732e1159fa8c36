"""A character-level LSTM language model as a task (`task: char_lm:build`).

The text is read in order, in the classic `batchify` layout: the corpus is cut into
`streams` parallel streams, and chunk i of `bptt` characters from every stream is dataset
item i (a DataLoader with batch_size 1 and a collate that unwraps it). The LSTM's hidden
state runs on from one chunk to the next (truncated backpropagation through time): it is
the task's own state, a `stateful` part, so a resumed run continues from the very hidden
state the interrupted one had reached. It starts from zeros at chunk 0 of every epoch.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckpt_trainer import ConfigError, Task, TaskArgs

CORPUS = Path(__file__).with_name("corpus.txt")
DEFAULTS = {"bptt": 32, "streams": 8, "embed": 32, "hidden": 128, "layers": 1,
            "dropout": 0.1, "eval_fraction": 0.1}


def batchify(ids: torch.Tensor, streams: int) -> torch.Tensor:
    """(n,) -> (n // streams, streams): column j is the j-th contiguous stream of text."""
    n = ids.numel() // streams
    return ids[: n * streams].view(streams, n).t().contiguous()


class Chunks(torch.utils.data.Dataset):
    """Item i: (i, input, target), `bptt` rows of every stream; target is input shifted by one."""

    def __init__(self, source: torch.Tensor, bptt: int):
        self.source, self.bptt = source, bptt

    def __len__(self) -> int:
        return (len(self.source) - 1) // self.bptt

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        s = i * self.bptt
        return i, self.source[s:s + self.bptt], self.source[s + 1:s + 1 + self.bptt]


def unwrap(items: list[Any]) -> Any:
    """Collate for batch_size 1: each item already is a whole batch of streams."""
    (item,) = items
    return item


class CharLSTM(nn.Module):
    def __init__(self, vocab: int, embed: int, hidden: int, layers: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.drop = nn.Dropout(dropout)
        self.rnn = nn.LSTM(embed, hidden, layers, dropout=dropout if layers > 1 else 0.0)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]):
        out, state = self.rnn(self.drop(self.embed(x)), state)
        return self.head(self.drop(out)), state


class CarriedState:
    """The LSTM's (h, c) after the last chunk trained on, detached from its graph."""

    def __init__(self, layers: int, streams: int, hidden: int):
        self.h = torch.zeros(layers, streams, hidden)
        self.c = torch.zeros(layers, streams, hidden)

    def reset(self) -> None:
        self.h, self.c = torch.zeros_like(self.h), torch.zeros_like(self.c)

    def keep(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.h, self.c = state[0].detach(), state[1].detach()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"h": self.h, "c": self.c}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if state["h"].shape != self.h.shape:
            raise ValueError(f"hidden state saved as {tuple(state['h'].shape)}, the model "
                             f"now needs {tuple(self.h.shape)}")
        self.h, self.c = state["h"].clone(), state["c"].clone()


def build(t: TaskArgs) -> Task:
    unknown = set(t.args) - set(DEFAULTS)
    if unknown:
        raise ConfigError(f"unknown task_args for char_lm: {', '.join(sorted(unknown))}. "
                          f"Allowed: {', '.join(sorted(DEFAULTS))}")
    a = {**DEFAULTS, **t.args}
    path = Path(t.dataset.removeprefix("file://")) if t.dataset else CORPUS
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"char_lm: cannot read the text at {path} ({e.strerror}); set the "
                          "config's dataset to a UTF-8 text file, or drop it to use "
                          "corpus.txt") from None
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(ch) for ch in text], dtype=torch.long)
    n_eval = int(len(ids) * a["eval_fraction"])
    train_ids, eval_ids = ids[:len(ids) - n_eval], ids[len(ids) - n_eval:]

    torch.manual_seed(t.seed)
    model = CharLSTM(len(vocab), a["embed"], a["hidden"], a["layers"], a["dropout"])
    carried = CarriedState(a["layers"], a["streams"], a["hidden"])
    loss_f = nn.CrossEntropyLoss()

    def loss_fn(m: nn.Module, batch: tuple[int, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        i, x, y = batch
        if i == 0:
            carried.reset()  # a new pass over the text
        logits, state = m(x, (carried.h, carried.c))
        carried.keep(state)
        return loss_f(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def eval_fn(m: nn.Module) -> dict[str, float]:
        x, y = eval_ids[:-1].unsqueeze(1), eval_ids[1:].unsqueeze(1)  # one stream
        zeros = torch.zeros(a["layers"], 1, a["hidden"])
        logits, _ = m(x, (zeros, zeros))
        loss = float(loss_f(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)))
        return {"loss": loss, "bits_per_char": loss / math.log(2)}

    return Task(model=model, train_data=Chunks(batchify(train_ids, a["streams"]), a["bptt"]),
                loss_fn=loss_fn, eval_fn=eval_fn, collate=unwrap,
                stateful={"hidden": carried},
                data_version=hashlib.sha256(text.encode()).hexdigest())
