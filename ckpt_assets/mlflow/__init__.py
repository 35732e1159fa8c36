"""MLflow: one MLflow run per training run across its attempts (params, metrics on one
step axis, attempt tags, the final model registered once)."""
