"""The code location: `ckpt_assets.definitions:defs` (loaded by workspace.yaml)."""

from __future__ import annotations

import dagster as dg

from ckpt_assets.defs.assets import TRAINING_ASSETS
from ckpt_assets.defs.check_runs import CHECK_SENSORS
from ckpt_assets.defs.checks import TRAINING_CHECKS
from ckpt_assets.defs.io_managers import CheckpointIOManager
from ckpt_assets.defs.jobs import JOBS
from ckpt_assets.defs.resources import CheckpointStore, MLflowResource, TrainerResource
from ckpt_assets.defs.sensors import SENSORS


def make_resources(store_uri: str | None = None, *, tracking_uri: str | None = None,
                   mlflow_experiment: str | None = None, store: CheckpointStore | None = None,
                   trainer: TrainerResource | None = None,
                   mlflow: MLflowResource | None = None) -> dict:
    """The resources the jobs need; defaults resolve at run time (see resources.py)."""
    store = store or CheckpointStore(uri=store_uri)
    return {
        "checkpoint_store": store,
        "trainer": trainer or TrainerResource(),
        "mlflow_tracking": mlflow or MLflowResource(tracking_uri=tracking_uri,
                                                     experiment_name=mlflow_experiment),
        "checkpoint_io_manager": CheckpointIOManager(store=store),
    }


defs = dg.Definitions(
    assets=TRAINING_ASSETS,
    asset_checks=TRAINING_CHECKS,
    jobs=JOBS,
    sensors=[*SENSORS, *CHECK_SENSORS],
    resources=make_resources(),
    # Also for implicit jobs (`dagster asset materialize`, the UI's Materialize button): the
    # step runs in the run's own process, so killing that process stops the trainer too.
    executor=dg.in_process_executor,
)
