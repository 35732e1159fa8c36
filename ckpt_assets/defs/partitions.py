"""The `training_runs` dynamic partitions: one partition key per training run (its name).

Keys are added when a run is registered (`ckpt_assets.base.registration`), which validates them.
"""

import dagster as dg

from ckpt_assets.base.names import PARTITIONS_NAME

training_runs = dg.DynamicPartitionsDefinition(name=PARTITIONS_NAME)
