"""Built-in task: a small MLP classifier on a synthetic dataset generated from a seed.

Small enough to train in seconds on a CPU, yet it exercises everything a resume must get
right: dropout (RNG), a shuffling sampler, AdamW, warm-up schedule, clipping, evaluation.

The config's `dataset` may name a file written by `write_dataset` (a path, or an
s3://bucket/key object it was uploaded to); without one the data
is generated in memory from these task_args:
  data_seed, n_train, n_eval, features, classes   the generated dataset (defaults below)
  hidden, dropout                                 the model
  step_delay    seconds to sleep per step (makes a run long enough to interrupt in demos)
  pause_after_step  with this step done, wait for a signal before the next one, in an
                attempt that started from step 1 (a resumed one never pauses): a demo or a
                test interrupts the run at a step it chose, with no clock to race
  fail_at_step  raise an ordinary exception (a bug) before this step
  crash_at_step kill this process with SIGKILL before this step, every attempt
  nan_at_step   make the loss NaN at this step (divergence)
"""

from __future__ import annotations

import hashlib
import io
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..api.task import Task, TaskArgs
from ..base.errors import ConfigError, StorageError

ALLOWED = {"data_seed", "n_train", "n_eval", "features", "classes", "hidden",
           "dropout", "step_delay", "pause_after_step", "fail_at_step", "crash_at_step", "nan_at_step"}


def make_dataset(data_seed: int = 1234, n_train: int = 2048, n_eval: int = 512,
                 features: int = 32, classes: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(data_seed)
    centers = torch.randn(classes, features, generator=g) * 0.3
    n = n_train + n_eval
    y = torch.randint(0, classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, features, generator=g)
    return {"x_train": x[:n_train].contiguous(), "y_train": y[:n_train].contiguous(),
            "x_eval": x[n_train:].contiguous(), "y_eval": y[n_train:].contiguous()}


def dataset_hash(data: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(data):
        h.update(k.encode())
        h.update(data[k].numpy().tobytes())
    return h.hexdigest()


def write_dataset(path: str | Path, **kwargs: Any) -> str:
    """Write the dataset to `path` atomically; return its content hash (the data version)."""
    data = make_dataset(**kwargs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(data, tmp)
    os.replace(tmp, path)
    return dataset_hash(data)


def load_dataset(uri: str) -> dict[str, torch.Tensor]:
    path = uri.removeprefix("file://")
    try:
        if uri.startswith("s3://"):  # one object, as `write_dataset` wrote it
            path = _s3_object(uri)
        data = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"dataset {uri} does not exist; write it with "
                          "trainer.tasks.toy.write_dataset or drop 'dataset' to generate data") from None
    except StorageError:
        raise
    except Exception as e:
        raise ConfigError(f"dataset {uri} is not a dataset file of the toy task: {e}") from None
    return data


def _s3_object(uri: str) -> io.BytesIO:
    from ..storage.s3 import read_uri

    return io.BytesIO(read_uri(uri))


class MLP(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int, dropout: float):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(dropout),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


STOPS = (signal.SIGTERM, signal.SIGINT)


class Hold:
    """`pause_after_step`: wait before step `after + 1` until a stop signal comes, then hand
    that signal to the session's handler, which acts on it as it would mid-step.

    From the start of step `after`, a stop signal is only recorded here, so one sent as soon
    as the heartbeat says that step is done cannot stop that step. Masking the signals
    instead would not do: the mask is per thread, so the kernel hands the signal to one of
    torch's worker threads and Python runs the session's handler all the same. The wait
    polls every 0.1 s because a signal taken on another thread only reaches Python's
    handlers when the main thread runs bytecode again. The handler takes no lock: it runs
    between two bytecodes of the main thread, which may hold that very lock (an Event's,
    inside its `wait`), and would wait for itself forever, deaf to every later SIGTERM."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.signum = 0
        self.saved: dict = {}

    def __call__(self, step: int) -> None:
        if step == self.after:
            self.saved = {s: signal.signal(s, self._record) for s in STOPS}
        elif step == self.after + 1:
            while not self.signum:
                time.sleep(0.1)
            for s, handler in self.saved.items():
                signal.signal(s, handler)
            signal.raise_signal(self.signum)

    def _record(self, signum: int, _frame) -> None:
        self.signum = signum


def build(t: TaskArgs) -> Task:
    a = t.args
    unknown = set(a) - ALLOWED
    if unknown:
        raise ConfigError(f"unknown task_args for the toy task: {', '.join(sorted(unknown))}. "
                          f"Allowed: {', '.join(sorted(ALLOWED))}")
    if t.dataset:
        data = load_dataset(t.dataset)
    else:
        data = make_dataset(**{k: a[k] for k in ("data_seed", "n_train", "n_eval", "features",
                                                 "classes") if k in a})
    features = data["x_train"].shape[1]
    classes = int(max(data["y_train"].max(), data["y_eval"].max())) + 1
    torch.manual_seed(t.seed)
    model = MLP(features, int(a.get("hidden", 64)), classes, float(a.get("dropout", 0.1)))
    train = list(zip(data["x_train"], data["y_train"], strict=True))
    loss_f = nn.CrossEntropyLoss()
    nan_at = a.get("nan_at_step")

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        loss = loss_f(m(x), y)
        return loss * float("nan") if state["step"] == nan_at else loss

    @torch.no_grad()
    def eval_fn(m: nn.Module) -> dict[str, float]:
        logits = m(data["x_eval"])
        return {"loss": float(loss_f(logits, data["y_eval"])),
                "accuracy": float((logits.argmax(1) == data["y_eval"]).float().mean())}

    state = {"step": 0, "first": None}
    delay = float(a.get("step_delay", 0.0))
    pause_after = a.get("pause_after_step")
    if pause_after is not None and (type(pause_after) is not int or pause_after < 1):
        raise ConfigError(f"task_args 'pause_after_step' must be a whole number >= 1 (got "
                          f"{pause_after!r}): the step after which a fresh attempt waits")
    hold = Hold(pause_after) if pause_after is not None else None

    def before_step(step: int) -> None:
        state["step"] = step
        state["first"] = state["first"] or step
        if hold is not None and state["first"] == 1:
            hold(step)
        if step == a.get("fail_at_step"):
            raise RuntimeError(f"injected bug at step {step}")
        if step == a.get("crash_at_step"):
            os.kill(os.getpid(), signal.SIGKILL)
        if delay:
            time.sleep(delay)

    return Task(model=model, train_data=train, loss_fn=loss_fn, eval_fn=eval_fn,
                data_version=dataset_hash(data), before_step=before_step)
