"""Three failures of one run on an S3 store: two seen by the failure sensor and the
reconciler's tick in the same daemon loop (whoever is first decides), one by the reconciler
alone while the failure sensor is off (as for failures from before it was on); each resumed
once, by the one launcher of resumes, the reconciler.

The subject is who resumes each failure, once; that a trainer reached only through S3
resumes bit for bit is tests/orchestrator/test_remote_trainer.py's."""

from __future__ import annotations

import signal
import uuid

import boto3
import pytest

from ckpt_assets.lifecycle.settings import Setting
from tests.daemon_harness import Daemon, held, kill, training_config
from tests.s3_state import final_state_s3

pytestmark = pytest.mark.slow

MAX_STEPS = 70  # the third kill comes 5 steps after the reconciler's resume at ~30


def _sensor(daemon: Daemon, verb: str) -> None:
    """`dagster sensor stop|start resume_failed_training`, which must succeed."""
    res = daemon.dagster("sensor", verb, "resume_failed_training", "-w", str(daemon.workspace))
    assert res.returncode == 0, res.stdout + res.stderr


def test_three_failures_of_an_s3_run_one_seen_only_by_the_reconciler_are_each_resumed_once(
        moto_server, tmp_path, monkeypatch):
    bucket = f"e2e-{uuid.uuid4().hex[:8]}"
    aws = {"AWS_ENDPOINT_URL": moto_server, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    for k, v in aws.items():  # this process reads heartbeats and the final state too
        monkeypatch.setenv(k, v)
    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing"
                 ).create_bucket(Bucket=bucket)
    store = f"s3://{bucket}/ckpts"

    cfg = training_config("s3run", max_steps=MAX_STEPS,
                          task_args={"n_train": 512, "n_eval": 128, "hidden": 32, "step_delay": 0.2})

    # The point is the sensors' and the reconciler's resumes, each a new run: a trainer
    # killed while its run worker lives would otherwise be relaunched in its own run.
    # The trainer is held (SIGSTOP) across `dagster sensor` commands below, each of which
    # loads the workspace: on a slow machine longer than the heartbeat timeout, and this
    # test is not about a trainer declared dead.
    daemon = Daemon.start(tmp_path / "d", store,
                          extra_env={**aws, Setting.IN_RUN_RELAUNCH.value: "0",
                                     Setting.HEARTBEAT_TIMEOUT_S.value: "900"})
    try:
        daemon.launch("s3run", cfg, tmp_path)
        hb = daemon.wait_for_step("s3run", 12, attempt=1)
        kill(hb["pid"], signal.SIGKILL)  # 1: failure sensor
        hb = daemon.wait_for_step("s3run", 1, attempt=2)
        # Held while the failure sensor stops: an evaluation the daemon began before the stop
        # can still run after it, and on a busy machine one saw the next kill. So the kill
        # waits for a daemon loop begun after the stop (another sensor's tick) and for no
        # evaluation of the stopped sensor in flight.
        with held(hb["pid"]):
            _sensor(daemon, "stop")
            daemon.wait_for_ticks({"resume_terminated_training": 1})
            daemon.wait_until(lambda: not daemon.tick_in_flight("resume_failed_training"),
                              "the stopped sensor's last evaluation to end")
        hb = daemon.wait_for_step("s3run", 30, attempt=2)
        kill(hb["pid"], signal.SIGKILL)  # 2: only the reconciler can see this one
        daemon.wait_until(lambda: len(daemon.runs("s3run")) == 3, "the reconciler's resume")
        # The reconciler's resume is attempt 3. It is held (SIGSTOP) while the sensor comes
        # back, so that on a slow machine it cannot train to the end before the kill below.
        now = daemon.wait_for_step("s3run", 1, attempt=3)
        with held(now["pid"]):
            _sensor(daemon, "start")
            # The re-enabled sensor's first tick only sets its cursor: failures before it
            # are not its to see. Wait for that tick, not for a guess at its interval.
            daemon.wait_for_ticks({"resume_failed_training": 1})
        assert now["step"] < MAX_STEPS, now
        hb = daemon.wait_for_step("s3run", now["step"] + 5, attempt=3)
        kill(hb["pid"], signal.SIGTERM)  # 3: failure sensor again (a preemption)
        final = daemon.wait_done("s3run")
        runs = daemon.runs("s3run")
        assert len(runs) == 4, [(r.run_id[:8], r.status.value) for r in runs]
        for failed, child in zip(runs, runs[1:], strict=False):
            assert child.tags["ckpt/parent_run_id"] == failed.run_id
            resumes = [r for r in daemon.instance.get_runs()
                       if r.tags.get("ckpt/parent_run_id") == failed.run_id]
            assert len(resumes) == 1
        assert [r.tags.get("ckpt/failure_kind") for r in runs[:3]] == ["killed", "killed",
                                                                       "preempted"]
        # Decided by whichever sensor was first, the reconciler alone, whichever was first;
        # launched by one sensor.
        assert [r.tags.get("dagster/sensor_name") for r in runs[1:]] == [
            "reconcile_training_runs"] * 3
        assert final.tags["ckpt/attempt"] == "4"
        assert daemon.max_active["s3run"] == 1
        # The last checkpoint is the run's end, and it verifies as read back from S3.
        assert final_state_s3(store, run="s3run")["loop"]["step"] == MAX_STEPS
    finally:
        daemon.stop()
