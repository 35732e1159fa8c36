"""What people read about a training run: lineage, the `list` row, the metrics history,
versions of asset values, and Dagster metadata. Reads only: nothing here changes a run."""
