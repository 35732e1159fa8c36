"""Names of the Dagster objects that other code looks up by name (the jobs and the
partitions definition) and where the project's own files are. Free of project imports, so
every layer below `defs/` reads them without importing the definitions themselves."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # ckpt_assets/base/names.py
WORKSPACE_FILE = REPO_ROOT / "workspace.yaml"

PARTITIONS_NAME = "training_runs"
TRAIN_JOB = "train_job"
TRAIN_DEMO_JOB = "train_demo"  # train_job with the demo config as its default
CHECK_JOB = "check_training_run"
STOP_JOB = "stop_training_run"
NEW_RUN_JOB = "new_training_run"  # register a run by name, then launch train_job for it

# The jobs whose runs are training runs (each a chain of attempts of one partition).
TRAINING_JOB_NAMES = frozenset({TRAIN_JOB, TRAIN_DEMO_JOB})
