"""The baseline of `bench_goodput.py`: a training job as a Dagster user writes it today.

One op runs the same trainer on the same config as a plain subprocess, with nothing of
ckpt-assets around it: Dagster's own run retries (`dagster/max_retries`, from failure)
re-execute the op after a failure, and each execution starts from step 0 in a store of its
own (the retry knows no checkpoint). Loaded as a code location of its own by the
benchmark's second daemon (`workspace.yaml` written there), never by the project.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

import dagster as dg

ROOT = Path(__file__).resolve().parents[1]
JOB = "plain_train_job"
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # A killed run worker takes its trainer with it, as a pod's containers go together;
    # otherwise the orphan would train on beside the retry.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def store_of(store_root: str, run_id: str) -> Path:
    """The store of one execution: nothing of an earlier one is in it."""
    return Path(store_root) / run_id


@dg.op(config_schema={"config": str, "store_root": str})
def train_from_scratch(context) -> None:
    cfg = context.op_config
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CKPT_", "DAGSTER_"))}
    argv = [sys.executable, "-m", "trainer", "--config", cfg["config"],
            "--store", str(store_of(cfg["store_root"], context.run_id)), "--resume", "never"]
    proc = subprocess.Popen(argv, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                            preexec_fn=_die_with_parent)
    rc = proc.wait()
    if rc != 0:
        raise dg.Failure(f"the trainer exited {rc}; a retry starts it again from step 0")


@dg.job(executor_def=dg.in_process_executor)
def plain_train_job() -> None:
    train_from_scratch()


defs = dg.Definitions(jobs=[plain_train_job])
