"""Another world size through Dagster: a run of two ranks (its model sharded with FSDP2 in
task mode) preempted, continued by one rank, preempted again and finished by two, each a
`ckpt-assets run` of the same registered run (real processes, real signals). Every
checkpoint sits at its global sample position whatever the world size that wrote it, and
the Dagster runs chain as one training run's attempts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import dagster as dg
import pytest
import torch

from ckpt_assets.base.queries import training_runs_of
from ckpt_assets.base.view import RunView
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import PYTHON, ROOT, pointer_step, training_config
from tests.polling import wait_for

pytestmark = pytest.mark.slow

NAME, STEPS, BATCH, SAMPLES = "elastic", 36, 32, 512


def _run(tmp_path: Path, *args: str, until: int | None = None, store: str = "") -> int:
    """`ckpt-assets run NAME ARGS`, SIGTERMed (as a preemption) once step `until` is
    committed; its exit code."""
    with open(tmp_path / "runs.log", "ab") as log:
        proc = subprocess.Popen([PYTHON, "-m", "ckpt_assets", "run", NAME, *args], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        if until is not None:
            wait_for(lambda: proc.poll() is None and
                     (pointer_step(Path(store), "default", NAME) or 0) >= until, 300,
                     what=f"step {until} committed")
            proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()


def _checkpoints(store: str) -> dict[int, tuple[int, dict]]:
    """step -> (the world size that wrote it, its data position) of every checkpoint."""
    out = {}
    for d in (Path(store) / "default" / NAME / "checkpoints").glob("step-*"):
        manifest = json.loads((d / "MANIFEST.json").read_text())
        state_file = sorted(f for f in manifest["files"] if f.startswith("state"))[0]
        data = torch.load(d / state_file, weights_only=True)["data"]
        out[manifest["step"]] = (manifest["meta"].get("world_size") or 1, data)
    return out


def test_two_ranks_then_one_then_two_through_dagster_keep_every_checkpoint_at_its_global_sample_position(  # noqa: E501
        tmp_path, dagster_home, store_uri, mlflow_uri):
    config = tmp_path / "elastic.json"
    config.write_text(json.dumps(training_config(
        max_steps=STEPS, eval_every=12, batch_size=BATCH,
        checkpoint={"every_steps": 4, "keep_last": 100},
        distributed={"nproc_per_node": 2, "strategy": "fsdp"},
        task_args={"n_train": SAMPLES, "step_delay": 0.1})))
    log = tmp_path / "runs.log"
    assert _run(tmp_path, "--config", str(config), until=12, store=store_uri) == 143, \
        log.read_text()[-3000:]
    # A loaded machine may see the first run commit well past step 12 before its SIGTERM
    # lands: the second is stopped only once it has committed steps of its own.
    first = pointer_step(Path(store_uri), "default", NAME)
    assert first < STEPS - 8, first
    assert _run(tmp_path, "--nproc-per-node", "1", until=max(24, first + 4),
                store=store_uri) == 143, log.read_text()[-3000:]
    assert _run(tmp_path, "--nproc-per-node", "2") == 0, log.read_text()[-3000:]

    checkpoints = _checkpoints(store_uri)
    assert max(checkpoints) == STEPS
    assert {world for world, _ in checkpoints.values()} == {1, 2}
    per_epoch = SAMPLES // BATCH
    for step, (_, data) in checkpoints.items():
        # One global batch a step, whatever the world size: no sample lost or repeated.
        assert data["epoch"] * per_epoch + data["position"] == step, step
    runs = [RunView.of(r) for r in reversed(training_runs_of(dg.DagsterInstance.get(), NAME))]
    assert [(v.attempt, v.world) for v in runs] == [
        (1, {}), (2, {"nproc_per_node": "1"}), (3, {"nproc_per_node": "2"})]
    assert runs[1].parent_run_id == runs[0].run_id and runs[2].parent_run_id == runs[1].run_id
