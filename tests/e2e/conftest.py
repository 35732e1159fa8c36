"""What the end-to-end modules share: one daemon for the sensors' resumes."""

from __future__ import annotations

import pytest

from ckpt_assets.lifecycle.settings import Setting
from tests.daemon_harness import Daemon

SHARED = "sensors_daemon"


class SharedDaemon:
    """A real dagster-daemon and its code server on the embedded instance, with the in-run
    relaunch off, so that every failure is resumed by the sensors as a new run. Shared by the
    modules that prove those resumes (test_auto_resume_e2e on the embedded instance,
    test_ranks_dagster); each test trains a partition of its own. The other end-to-end
    daemons differ in what is the daemon's, not a run's: test_liveness_e2e's heartbeat
    timeout, test_auto_resume_s3_e2e's store on S3, test_in_run_relaunch's shipped settings,
    test_cli_dagster's plain `dagster-daemon run -w workspace.yaml`.

    Started by the first test that needs it, and stopped as soon as the next test this
    worker runs does not (`pytest_runtest_teardown`): idle, a daemon and its code server
    still keep about a tenth of a core busy with sensor ticks, for the rest of the session
    on a machine whose every core the other tests' trainers are waiting for."""

    def __init__(self, tmp_path_factory) -> None:
        self._tmp = tmp_path_factory
        self._daemon: Daemon | None = None

    def get(self) -> Daemon:
        if self._daemon is None:
            work = self._tmp.mktemp("sensors-daemon")
            self._daemon = Daemon.start(work, str(work / "store"),
                                        extra_env={Setting.IN_RUN_RELAUNCH.value: "0"})
        return self._daemon

    def release(self) -> None:
        if self._daemon is not None:
            self._daemon.stop()
            self._daemon = None


@pytest.fixture(scope="session")
def sensors_daemon(tmp_path_factory):
    shared = SharedDaemon(tmp_path_factory)
    yield shared
    shared.release()


def pytest_runtest_teardown(item, nextitem):
    if nextitem is not None and SHARED in getattr(nextitem, "fixturenames", ()):
        return
    shared = (getattr(item, "funcargs", None) or {}).get(SHARED)
    if isinstance(shared, SharedDaemon):
        shared.release()
