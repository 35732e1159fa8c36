"""A training run whose MLflow run opens only after its trainer committed every checkpoint
(the MLflow database's lock held meanwhile, as run workers migrating a new database hold it)
and whose retention keeps 3: MLflow's `loss` history is still the run's checkpoint history,
step for step.

A real `model_checkpoint` run (trainer process under Pipes, local store, on-disk Dagster
instance, local MLflow sqlite store). The lock is this test's: it is taken before the run
starts and released once Dagster has recorded the final checkpoint, so the attempt handles
every report while MLflow is still closed and its process has exited; `TRACKING_OPEN_WAIT_S`
is 0 so the attempt does not wait out MLflow's start-up before it ends (production waits
30 s, with the same outcome).
"""

from __future__ import annotations

import fcntl
import shutil
import threading

import dagster as dg
import pytest
from mlflow.tracking import MlflowClient

import ckpt_assets.attempt.process as attempt_process
from ckpt_assets.base.events import CHECKPOINT, partition_events
from ckpt_assets.definitions import make_resources
from ckpt_assets.mlflow.tracking import TRAINING_RUN_TAG
from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import instance_in, made_mlflow_db, materialize_run, training_config
from tests.polling import wait_for

pytestmark = pytest.mark.slow

KEY = "opened-late"
MAX_STEPS = 60


def _recorded(instance: dg.DagsterInstance) -> dict[str, tuple[int, float]]:
    """Dagster's checkpoint history of the run: name -> (step, loss)."""
    return {md["name"]: (int(md["step"]), md["loss"])
            for md, _ in partition_events(instance, KEY, CHECKPOINT)}


class HeldLock(threading.Thread):
    """The MLflow database's lock, held until Dagster has recorded the final checkpoint."""

    def __init__(self, db: str, home):
        super().__init__(daemon=True)
        self.file = open(f"{db}.lock", "a")  # noqa: SIM115 (closed by release)
        fcntl.flock(self.file, fcntl.LOCK_EX)
        self.home = home
        self.seen_at_release: dict[str, tuple[int, float]] = {}

    def run(self) -> None:
        try:
            with instance_in(self.home) as instance:
                self.seen_at_release = wait_for(
                    lambda: (rec := _recorded(instance)) and max(s for s, _ in rec.values())
                    >= MAX_STEPS and rec, 600, 0.2, "the final checkpoint's record")
        finally:
            self.release()

    def release(self) -> None:
        if not self.file.closed:
            self.file.close()  # releases the flock


@pytest.fixture(scope="module")
def late_run(blank_dagster_home, tmp_path_factory):
    base = tmp_path_factory.mktemp("late-open")
    home = base / "dagster_home"
    shutil.copytree(blank_dagster_home, home)
    tracking = made_mlflow_db(base / "mlflow.db")
    store = base / "store"
    cfg = training_config(max_steps=MAX_STEPS, checkpoint={"keep_last": 3})
    held = HeldLock(tracking[len("sqlite:///"):], home)
    with instance_in(home) as instance, pytest.MonkeyPatch.context() as mp:
        mp.setattr(attempt_process, "TRACKING_OPEN_WAIT_S", 0.0)
        held.start()
        try:
            result = materialize_run(instance, KEY, make_resources(str(store),
                                                                   tracking_uri=tracking),
                                     training=cfg, with_checks=False)
        finally:
            held.release()
            held.join(60)
        yield {"result": result, "instance": instance, "tracking": tracking, "store": store,
               "held": held}


def test_mlflow_loss_history_equals_the_checkpoint_history_when_mlflow_opened_after_every_commit(
        late_run):
    assert late_run["result"].success
    recorded = _recorded(late_run["instance"])
    # MLflow opened late: every checkpoint was committed and recorded before its lock freed,
    # and retention (keep_last 3, and the best) removed most of them from the store.
    assert late_run["held"].seen_at_release == recorded
    kept = list((late_run["store"] / "default" / KEY / "checkpoints").glob("step-*"))
    assert len(kept) <= 4 < len(recorded)

    client = MlflowClient(tracking_uri=late_run["tracking"])
    exp = client.get_experiment_by_name("default")
    (run,) = client.search_runs([exp.experiment_id],
                                filter_string=f"tags.{TRAINING_RUN_TAG} = '{KEY}'")
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert loss == sorted(recorded.values())  # no hole, no step twice
    sizes = [m.step for m in client.get_metric_history(run.info.run_id, "checkpoint_bytes")]
    assert sorted(sizes) == sorted(s for s, _ in recorded.values())
