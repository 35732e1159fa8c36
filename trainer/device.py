"""Device and mixed precision: `device: auto|cpu|cuda[:N]`, `amp.dtype: bfloat16|float16`."""

from __future__ import annotations

import contextlib
import logging

import torch

from .base.errors import ConfigError

log = logging.getLogger("trainer")

AMP_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(spec: str) -> torch.device:
    """`auto` picks CUDA when present and says which it picked; an absent CUDA is bad input."""
    if spec == "auto":
        if torch.cuda.is_available():
            dev = torch.device("cuda")
            log.info("device auto: using CUDA (%s)", torch.cuda.get_device_name(dev))
        else:
            dev = torch.device("cpu")
            log.info("device auto: no CUDA device available, using CPU")
        return dev
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"config key 'device' is {spec!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"config key 'device' is {spec!r} but this machine has no CUDA "
                          "device; use device: auto or cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"config key 'device' is {spec!r}: use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"config key 'device' is {spec!r} but this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s), numbered from 0; use "
                          "device: auto or an index below the count")
    return dev


def autocast(device: torch.device, dtype_name: str | None):
    """The autocast context for one forward pass (a no-op without AMP)."""
    if dtype_name is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[dtype_name])


def grad_scaler(device: torch.device, dtype_name: str | None) -> torch.amp.GradScaler:
    """float16 needs loss scaling; bfloat16 has float32's range and does not. The scaler's
    state is a checkpoint part either way, so the set of parts never depends on the dtype."""
    return torch.amp.GradScaler(device.type, enabled=dtype_name == "float16")
