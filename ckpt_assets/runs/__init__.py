"""What a training run is to Dagster: its names, tags, registered config, dataset, the
queries over its Dagster runs, and the one module of Dagster's private API."""
