"""What the end-to-end modules share: one daemon for the sensors' resumes."""

from __future__ import annotations

import pytest

from ckpt_assets.runs.settings import Setting
from tests.daemon_harness import Daemon


@pytest.fixture(scope="session")
def sensors_daemon(tmp_path_factory):
    """A real dagster-daemon and its code server on the embedded instance, with the in-run
    relaunch off, so that every failure is resumed by the sensors as a new run. Shared by the
    modules that prove those resumes (test_auto_resume_e2e on the embedded instance,
    test_ranks_dagster); each test trains a partition of its own. The other end-to-end
    daemons differ in what is the daemon's, not a run's: test_liveness_e2e's heartbeat
    timeout, test_auto_resume_s3_e2e's store on S3, test_in_run_relaunch's shipped settings,
    test_cli_dagster's plain `dagster-daemon run -w workspace.yaml`."""
    work = tmp_path_factory.mktemp("sensors-daemon")
    d = Daemon.start(work, str(work / "store"), extra_env={Setting.IN_RUN_RELAUNCH.value: "0"})
    yield d
    d.stop()
