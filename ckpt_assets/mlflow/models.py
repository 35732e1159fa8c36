"""What the MLflow run records of a final model: the exported weights as the run's `model`
artifact, the final metrics, and a version of the registered model.

Final models are registered under one registered model per MLflow experiment (named like
it), one version per training run, tagged `training_run`.
"""

from __future__ import annotations

import math

from ckpt_assets.mlflow.run import TRAINING_RUN_TAG, MlflowRun


class FinalModel:
    """The final model of one MLflow run, and its registered model version."""

    def __init__(self, run: MlflowRun):
        self.run = run

    @property
    def registered_model_name(self) -> str:
        """One registered model per MLflow experiment, named like it."""
        return self.run.resource.experiment_name or self.run.experiment

    def log_final_model(self, weights_path: str, metrics: dict[str, float], step: int,
                        description: str) -> str | None:
        """Log the exported weights + final metrics; register a model version if enabled."""
        run_id, client = self.run.run_id, self.run.client
        if run_id is None:
            return None
        version = None
        try:
            for k, v in metrics.items():
                if isinstance(v, int | float) and math.isfinite(v):
                    client.log_metric(run_id, f"final_{k}", float(v), step=int(step))
            client.log_artifact(run_id, weights_path, artifact_path="model")
            if self.run.resource.register_model:
                version = self._register(description, step)
        except Exception as e:
            self.run.warn("logging the final model", e)
        return version

    def _register(self, description: str, step: int) -> str:
        """The training run's version of the experiment's registered model (created once;
        a later final_model of the same run updates it: its source, the run's `model`
        artifact, is the same path and now holds the newer weights)."""
        name, client, run_id = self.registered_model_name, self.run.client, self.run.run_id
        training_run = self.run.training_run
        try:
            client.get_registered_model(name)
        except Exception:
            try:
                client.create_registered_model(
                    name, description=f"final models of the training runs of experiment {name}")
            except Exception:  # created concurrently by another training run
                client.get_registered_model(name)
        existing = client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
        if existing:
            mv = max(existing, key=lambda v: int(v.version))
            client.update_model_version(name, mv.version, description=description)
        else:
            run = client.get_run(run_id)
            mv = client.create_model_version(
                name, source=f"{run.info.artifact_uri}/model", run_id=run_id,
                description=description, tags={TRAINING_RUN_TAG: training_run})
        for k, v in {TRAINING_RUN_TAG: training_run, "experiment": self.run.experiment,
                     "step": str(step)}.items():
            client.set_model_version_tag(name, mv.version, k, v)
        return f"{name}/{mv.version}"
