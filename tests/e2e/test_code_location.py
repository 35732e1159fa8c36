"""One code location name wherever the project is loaded: `dagster dev` (from pyproject.toml),
workspace.yaml (the daemon, the CLI's launch, the tests). A run queued through one must be
found and run by a daemon that loaded the other."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib
import urllib.request
from pathlib import Path

import dagster as dg
import pytest
import yaml

from tests.dagster_fixtures import *  # noqa: F403
from tests.dagster_fixtures import DAGSTER, ROOT, cli, stop_process_group, training_config
from tests.polling import wait_for
from tests.ports import free_port


def test_pyproject_and_workspace_name_the_code_location_alike():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["dagster"]
    (entry,) = yaml.safe_load((ROOT / "workspace.yaml").read_text())["load_from"]
    assert tool["code_location_name"] == entry["python_module"]["location_name"] == "ckpt_assets"
    assert tool["module_name"] == entry["python_module"]["module_name"]


def _wait(pred, timeout: float, what: str, log: Path):
    return wait_for(pred, timeout, 0.5, what, lambda: log.read_text()[-3000:])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_a_run_launched_from_the_cli_while_dagster_dev_runs_is_run_by_its_daemon(
        tmp_path, dagster_home, store_uri, mlflow_uri):
    port = free_port()
    log_path = tmp_path / "dagster-dev.log"
    log = open(log_path, "wb")
    # Plain `dagster dev` from the repository root: it loads pyproject.toml's [tool.dagster].
    dev = subprocess.Popen([DAGSTER, "dev", "-p", str(port), "-h", "127.0.0.1"], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: _answers(f"http://127.0.0.1:{port}/server_info"), 180,
              "dagster dev's webserver", log_path)
        cfg = tmp_path / "cfg.json"
        cfg.write_text(json.dumps(training_config()))
        launched = cli("launch", "from-cli", "--config", str(cfg))
        assert launched.returncode == 0, launched.stderr
        instance = dg.DagsterInstance.get()
        (run,) = instance.get_runs()
        assert run.remote_job_origin.location_name == "ckpt_assets"
        _wait(lambda: instance.get_run_by_id(run.run_id).is_finished, 300,
              "dagster dev's daemon to run the queued run", log_path)
        assert instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.SUCCESS, \
            log_path.read_text()[-3000:]
    finally:
        stop_process_group(dev, grace=60)
        log.close()
