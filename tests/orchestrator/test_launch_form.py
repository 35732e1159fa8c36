"""The typed launch form: the launchpad's schema for `training` is the trainer's models.

Fast: Dagster's own config validation against the resolved jobs, no run is executed."""

from __future__ import annotations

import json
from typing import Any

import dagster as dg
import pytest
from pydantic import BaseModel

from ckpt_assets.base.registration import normalize_training_config
from ckpt_assets.defs.jobs import DEMO_CONFIG, JOBS
from ckpt_assets.runs.launch_form import (
    LAUNCH_DECIDES,
    TrainingForm,
    form_class,
    training_from_form,
)
from ckpt_assets.runs.training_run import TrainingRunConfig
from trainer.config import TrainConfig


@pytest.fixture(scope="module")
def defs() -> dg.Definitions:
    from ckpt_assets.definitions import defs as location

    # The project's assets and resources with every job of ckpt_assets.defs.jobs (the code
    # location registers them itself once definitions.py lists JOBS).
    return dg.Definitions(assets=location.assets, resources=location.resources, jobs=JOBS)


def _with_training(training: Any, op: str = "training_dataset") -> dict:
    return {"ops": {op: {"config": {"training": training}}}}


def _invalid(job: dg.JobDefinition, run_config: dict) -> str:
    with pytest.raises(dg.DagsterInvalidConfigError) as err:
        dg.validate_run_config(job, run_config)
    return str(err.value)


def _trainer_default(info) -> Any:
    return info.default_factory() if info.default_factory is not None else info.default


def test_the_launch_form_refuses_unknown_keys_wrong_types_and_values_outside_a_literal(defs):
    job = defs.resolve_job_def("train_job")
    assert "max_stepz" in _invalid(job, _with_training({"max_stepz": 5}))
    assert "lrr" in _invalid(job, _with_training({"optim": {"lrr": 0.1}}, op="model_checkpoint"))
    assert "max_steps" in _invalid(job, _with_training({"max_steps": "5"}))
    assert "float32" in _invalid(job, _with_training({"amp": {"dtype": "float32"}}))
    assert "task_args" in _invalid(job, _with_training({"task_args": [1, 2]}))


def test_a_partial_config_takes_the_trainers_default_for_every_key_it_leaves_out(defs):
    partial = {"max_steps": 7, "optim": {"lr": 0.01}, "amp": {"dtype": "bfloat16"},
               "task_args": {"hidden": 8, "sizes": [1, 2]}}
    resolved = dg.validate_run_config(defs.resolve_job_def("train_job"), _with_training(partial))
    training = resolved["ops"]["training_dataset"]["config"]["training"]
    expected = TrainConfig.model_validate(partial).model_dump(mode="json")
    for key in LAUNCH_DECIDES:  # left to the launch: "not given", never the trainer's default
        assert training.pop(key) is None
        expected.pop(key)
    assert training == expected


def test_a_launch_without_a_training_config_is_valid_and_carries_none(defs):
    resolved = dg.validate_run_config(defs.resolve_job_def("train_job"), {})
    assert all(op["config"]["training"] is None for op in resolved["ops"].values())


def test_the_forms_keys_defaults_and_help_are_the_trainers_models_key_by_key():
    """Walks the trainer's models and the Dagster schema the launchpad shows, side by side."""

    def walk(model: type[BaseModel], shape, path: str) -> int:
        assert set(shape.fields) == set(model.model_fields), path
        checked = 0
        for key, info in model.model_fields.items():
            field, where = shape.fields[key], f"{path}{key}"
            assert not field.is_required, where  # every key may be left out
            if info.description:
                assert field.description.startswith(info.description), where
            sub = info.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                checked += walk(sub, field.config_type, f"{where}.")
            elif path == "" and key in LAUNCH_DECIDES:
                assert field.default_value is None, where
            else:
                assert field.default_value == _trainer_default(info), where
                checked += 1
        return checked

    shape = TrainingForm.to_config_schema().as_field().config_type
    assert walk(TrainConfig, shape, "") > 30


def test_the_form_shows_each_keys_range_in_its_help():
    shape = TrainingForm.to_config_schema().as_field().config_type
    assert shape.fields["max_steps"].description.endswith("(>= 1, <= 999999999)")
    assert shape.fields["optim"].config_type.fields["lr"].description.endswith(
        "(> 0, <= 1000000.0)")
    assert shape.fields["optim"].config_type.fields["min_lr_ratio"].description.endswith(
        "(>= 0, <= 1)")


def test_a_config_given_through_the_form_registers_exactly_as_the_same_config_given_as_a_file(
        defs):
    given = {"max_steps": 40, "optim": {"lr": 1, "warmup_steps": 0},
             "checkpoint": {"every_steps": None, "heartbeat_seconds": 0},
             "task_args": {"n_train": 64}}
    resolved = dg.validate_run_config(defs.resolve_job_def("train_job"),
                                      _with_training(given))
    config = TrainingRunConfig(**resolved["ops"]["training_dataset"]["config"])
    from_form = training_from_form(config.training)
    for experiment in (None, "exp"):
        assert normalize_training_config(from_form, "form-run", experiment) == \
            normalize_training_config(given, "form-run", experiment)


def test_the_demo_preset_opens_with_the_demo_config_and_registers_it_as_the_cli_would(defs):
    job = defs.resolve_job_def("train_demo")
    run_config = job.partitioned_config.get_run_config_for_partition_key("demo-run")
    demo = json.loads(DEMO_CONFIG.read_text())
    assert run_config["ops"]["training_dataset"]["config"]["training"] == demo
    resolved = dg.validate_run_config(job, run_config)
    config = TrainingRunConfig(**resolved["ops"]["training_dataset"]["config"])
    assert normalize_training_config(training_from_form(config.training), "demo-run") == \
        normalize_training_config(demo, "demo-run")
    train_job = defs.resolve_job_def("train_job")
    assert job.tags == train_job.tags and job.executor_def.name == "in_process"
    assert set(job.asset_layer.executable_asset_keys) == set(
        train_job.asset_layer.executable_asset_keys)


def test_a_trainer_key_of_a_type_dagster_config_cannot_express_is_refused_by_name():
    class Odd(BaseModel):
        tags: set[str] = set()

    with pytest.raises(TypeError, match="'Odd.tags'"):
        form_class(Odd)
