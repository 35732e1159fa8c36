"""Names of the Dagster objects that other code looks up by name: the jobs and the
partitions definition. Free of imports, so the logic beside `defs/` (run queries, the
resume decision) reads them without importing the definitions themselves."""

PARTITIONS_NAME = "training_runs"
TRAIN_JOB = "train_job"
TRAIN_DEMO_JOB = "train_demo"  # train_job with the demo config as its default
CHECK_JOB = "check_training_run"
STOP_JOB = "stop_training_run"
NEW_RUN_JOB = "new_training_run"  # register a run by name, then launch train_job for it

# The jobs whose runs are training runs (each a chain of attempts of one partition).
TRAINING_JOB_NAMES = frozenset({TRAIN_JOB, TRAIN_DEMO_JOB})
