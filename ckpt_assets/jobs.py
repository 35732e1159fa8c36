"""`train_job`: the three training assets of one partition, in the run worker's process.

`in_process_executor` on purpose: the asset body (and the Pipes session that owns the
trainer) runs in the run worker itself, so killing the run worker kills the step too, and
the trainer (started with PR_SET_PDEATHSIG and CKPT_EXIT_WITH_PARENT=1) commits and stops.
With the multiprocess executor an orphaned step process could keep training and write
events into a run that Dagster already marked failed.

Dagster's own run retries stay off (`dagster/max_retries: 0`, and run_retries is disabled
in dagster_home/dagster.yaml): resuming is the resume sensor's decision, made once per
failure.
"""

from __future__ import annotations

import dagster as dg

from ckpt_assets.assets import TRAINING_ASSETS

train_job = dg.define_asset_job(
    "train_job",
    selection=dg.AssetSelection.assets(*TRAINING_ASSETS),
    executor_def=dg.in_process_executor,
    tags={"dagster/max_retries": "0", "dagster/retry_on_asset_or_op_failure": "false",
          "ckpt/job": "train"},
    description="Train (or resume) one training run: dataset -> trainer via Pipes -> final model.",
)
