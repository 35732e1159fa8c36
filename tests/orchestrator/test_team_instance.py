"""The team instance file (deploy/postgres/dagster.yaml): the embedded default's settings on
PostgreSQL storage, its connection from the environment alone."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.daemon_harness import EMBEDDED_INSTANCE_YAML, ROOT, fresh_instance
from tests.postgres_server import (
    POSTGRES_INSTANCE_YAML,
    instance_env_names,
)


def _load(path):
    return yaml.safe_load(path.read_text())


def test_the_team_instance_differs_from_the_embedded_default_in_its_storage_only():
    team, embedded = _load(POSTGRES_INSTANCE_YAML), _load(EMBEDDED_INSTANCE_YAML)
    assert "storage" not in embedded  # SQLite under DAGSTER_HOME: nothing to install
    assert list(team["storage"]) == ["postgres"]
    # Both start runs with Dagster's own launcher.
    assert embedded["run_launcher"]["class"] == "DefaultRunLauncher"
    assert {k: v for k, v in team.items() if k != "storage"} == embedded


def test_every_connection_setting_of_the_team_instance_comes_from_the_environment():
    db = _load(POSTGRES_INSTANCE_YAML)["storage"]["postgres"]["postgres_db"]
    names = instance_env_names()
    assert set(names) == {"hostname", "port", "username", "password", "db_name"}
    assert set(db) - set(names) == {"scheme"}  # the driver, not a setting of the server
    assert len(set(names.values())) == len(names)


@pytest.mark.slow
def test_a_run_recorded_on_the_team_instance_is_found_by_another_process_from_the_environment(
        tmp_path, postgres_server):
    server = postgres_server  # the session's; this test's own database on it
    server.create_database("team_probe")
    env_vars = server.instance_env("team_probe")
    home, env, instance = fresh_instance(tmp_path, str(tmp_path / "store"), env_vars,
                                         POSTGRES_INSTANCE_YAML)
    from dagster._core.test_utils import create_run_for_test

    run = create_run_for_test(instance, job_name="train_job")
    assert server.password not in (home / "dagster.yaml").read_text()
    read = ("from dagster import DagsterInstance; "
            "print(*[r.run_id for r in DagsterInstance.get().get_runs()])")
    found = subprocess.run([sys.executable, "-c", read], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == [run.run_id]
    without = {k: v for k, v in env.items() if k not in env_vars}
    missing = subprocess.run([sys.executable, "-c", read], cwd=ROOT, env=without,
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0
    assert instance_env_names()["password"] in missing.stderr
    instance.dispose()
