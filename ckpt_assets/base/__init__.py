"""What every layer of ckpt_assets stands on: a run's tags, names and view, its registration,
the attempt's end, one process identity, the queries and events of the instance, Dagster's
private API in one module. It imports nothing of the layers above it."""
