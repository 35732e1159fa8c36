"""An attempt as a Kubernetes pod, at the spec level: the pod `model_checkpoint` would
create, merged through dagster-k8s's own `build_pod_body` as `PipesK8sClient` does, for a
one-rank task run and a two-rank command run (and one node's pod of a several-node run:
test_k8s_job.py has the Job); the grace from the run's recorded saves; a pod deleted
(preempted) read as a preemption; bad settings refused (fast: no cluster, no process)."""

from __future__ import annotations

import json
import logging
import math
from types import SimpleNamespace

import dagster as dg
import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from ckpt_assets.attempt.command import AttemptIds, base_env, command_launch, contract, task_launch
from ckpt_assets.attempt.errors import TrainerStartError
from ckpt_assets.attempt.k8s_launch import KILLED, _create, _read, _Watch
from ckpt_assets.attempt.k8s_pod import (
    POD_WORKDIR,
    SHM_VOLUME,
    K8sTrainerConfig,
    attempt_trainer,
    k8s_config,
    pod_plan,
    termination_grace,
)
from ckpt_assets.base.datasets import DatasetRecord
from ckpt_assets.base.events import CHECKPOINT, MODEL_CHECKPOINT_KEY
from ckpt_assets.base.registration import Registration
from ckpt_assets.defs.resources import CheckpointStore, TrainerResource
from trainer.base.outcomes import Outcome
from trainer.checkpoints.repo import CheckpointRepo
from trainer.config import config_from_dict
from trainer.process.contract import Env, Progress, Stopped, to_message
from trainer.storage import open_store

SECRET = "s3cr3t-never-in-a-pod-spec"
PIPES_ENV = {"DAGSTER_PIPES_CONTEXT": "ctx", "DAGSTER_PIPES_MESSAGES": "msgs"}
STORE = "s3://team-bucket/ckpts"


@pytest.fixture
def store() -> CheckpointStore:
    return CheckpointStore(uri=STORE, endpoint_url="http://s3.internal:9000",
                           region_name="eu-west-1", aws_access_key_id="AKIAEXAMPLE",
                           aws_secret_access_key=SECRET)


def _trainer(**k8s_fields) -> TrainerResource:
    cfg = K8sTrainerConfig(**{"image": "registry.local/ckpt:1", "aws_secret": "ckpt-aws",
                              "service_account": "trainer", "node_selector": {"pool": "gpu"},
                              **k8s_fields})
    return TrainerResource(launcher="k8s", pipes="s3", k8s=cfg,
                           extra_env={"NCCL_DEBUG": "WARN"})


def _reg(run: str, raw: dict) -> Registration:
    config = config_from_dict({"run": run, "experiment": "exp", **raw})
    return Registration(run, "exp", config, f"{STORE}/exp/{run}/config.json", "0" * 64)


def _instance_with_saves(run: str, seconds: list[float]) -> dg.DagsterInstance:
    instance = dg.DagsterInstance.ephemeral()
    for i, s in enumerate(seconds):
        instance.report_runless_asset_event(dg.AssetObservation(
            MODEL_CHECKPOINT_KEY, partition=run,
            metadata={"event": CHECKPOINT, "name": f"step-{i}", "save_seconds": s}))
    return instance


def _context(instance) -> SimpleNamespace:
    return SimpleNamespace(instance=instance, log=logging.getLogger("test_k8s_pod"))


def _told(reg: Registration):
    ids = AttemptIds(3, "dagster-run-1", "dagster-root-1", "abc123")
    data = DatasetRecord(kind="uri", uri="s3://team-bucket/data/train.pt", version="v1")
    return contract(reg, STORE, ids, data)


def _manifest(plan) -> dict:
    """The pod as the API server receives it (camelCase), from the library's V1Pod."""
    return k8s.ApiClient().sanitize_for_serialization(plan.body(PIPES_ENV))


def _plan(launch, reg, trainer):
    cfg = k8s_config(trainer, STORE)
    grace = termination_grace(trainer.grace_period_seconds, (), cfg.grace_margin_seconds)
    return pod_plan(launch, reg, trainer, cfg, "dagster-run-1-model-checkpoint-1", grace)


def test_a_one_rank_task_attempt_is_a_pod_of_the_trainer_told_the_contract_and_no_secret(
        store, monkeypatch, tmp_path):
    monkeypatch.setenv("RUN_WORKER_ONLY", "the run worker's machine, not the pod's")
    reg = _reg("one-rank", {"task": "trainer.tasks.toy:build"})
    context = _context(_instance_with_saves("one-rank", [3.0, 14.5, 7.25]))
    trainer = attempt_trainer(context, reg, _trainer(), STORE)
    told = _told(reg)
    launch = task_launch(reg, told, base_env(trainer, store.aws_env()), trainer, tmp_path)
    pod = _manifest(_plan(launch, reg, trainer))

    spec, (container,) = pod["spec"], pod["spec"]["containers"]
    assert container["command"] == ["python", "-m", "trainer", "--config", reg.config_uri,
                                    "--store", STORE, "--resume", "auto", "--log-level", "INFO"]
    env = {e["name"]: e["value"] for e in container["env"]}
    contract_env = {k: v for k, v in told.to_env().items() if k != Env.EXIT_WITH_PARENT}
    assert env == {**PIPES_ENV, **contract_env, "NCCL_DEBUG": "WARN", "PYTHONUNBUFFERED": "1",
                   "AWS_ENDPOINT_URL": "http://s3.internal:9000",
                   "AWS_DEFAULT_REGION": "eu-west-1"}
    assert SECRET not in json.dumps(pod) and "AKIAEXAMPLE" not in json.dumps(pod)
    assert container["envFrom"] == [{"secretRef": {"name": "ckpt-aws"}}]
    # Twice the slowest recorded save (14.5 s) is above the configured 20 s grace.
    assert trainer.grace_period_seconds == 29.0
    assert spec["terminationGracePeriodSeconds"] == math.ceil(29.0 + 15.0)
    assert spec["restartPolicy"] == "Never"
    assert container["resources"] == {"requests": {"cpu": "1000m", "memory": "4096Mi"},
                                      "limits": {"cpu": "1000m", "memory": "4096Mi"}}
    assert container["image"] == "registry.local/ckpt:1"
    assert container["workingDir"] == POD_WORKDIR
    assert spec["serviceAccountName"] == "trainer" and spec["nodeSelector"] == {"pool": "gpu"}
    assert pod["metadata"]["name"] == "dagster-run-1-model-checkpoint-1"
    assert pod["metadata"]["labels"]["ckpt-assets/attempt"] == "3"
    assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "dagster"
    assert pod["metadata"]["annotations"]["ckpt-assets/run"] == "one-rank"


def test_a_two_rank_command_attempt_is_one_pod_under_trainer_ranks_sized_for_both_ranks(
        store, tmp_path):
    reg = _reg("two-ranks", {"command": ["python", "train.py", "--epochs", "3"],
                             "cwd": "examples/ddp", "env": {"MY_FLAG": "1"},
                             "distributed": {"nproc_per_node": 2}})
    context = _context(_instance_with_saves("two-ranks", [40.2]))
    trainer = attempt_trainer(context, reg, _trainer(cpu_per_rank=2, memory_gib_per_rank=1.5,
                                                     gpus_per_rank=1), STORE)
    repo = CheckpointRepo(open_store(str(tmp_path)), "exp", "two-ranks")
    told = _told(reg)
    launch = command_launch(reg, repo, told, base_env(trainer, store.aws_env()), trainer,
                            context.log)
    pod = _manifest(_plan(launch, reg, trainer))

    (container,) = pod["spec"]["containers"]
    # torchrun's grace is the measured one too: twice the 40.2 s save.
    assert container["command"] == [
        "python", "-m", "ckpt_trainer.ranks", "--nproc-per-node", "2", "--nnodes", "1",
        "--grace-seconds", "81", "--heartbeat-timeout-s", "30", "--", "python", "train.py",
        "--epochs", "3"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == math.ceil(80.4 + 15.0)
    amounts = {"cpu": "4000m", "memory": "3072Mi", "nvidia.com/gpu": "2"}
    assert container["resources"] == {"requests": amounts, "limits": amounts}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["MY_FLAG"] == "1" and env[Env.RUN] == "two-ranks" and env[Env.ATTEMPT] == "3"
    assert SECRET not in json.dumps(pod)
    assert container["workingDir"] == f"{POD_WORKDIR}/examples/ddp"
    assert {"name": SHM_VOLUME, "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_the_grace_is_the_configured_one_until_a_recorded_save_needs_more():
    assert termination_grace(20.0, [], 15.0).pod == 35
    assert termination_grace(20.0, [None, 4.0, float("nan")], 15.0).ranks == 20.0
    assert termination_grace(20.0, [4.0, 12.5], 10.0).ranks == 25.0
    assert termination_grace(20.0, [4.0, 12.5], 10.0).pod == 35


@pytest.mark.parametrize("trainer,store_uri,says", [
    (TrainerResource(launcher="k8s", pipes="s3"), STORE, "TrainerResource.k8s is not set"),
    (TrainerResource(launcher="k9s"), STORE, "use one of local, k8s"),
    (TrainerResource(launcher="k8s", k8s=K8sTrainerConfig(image="i")), STORE,
     "needs TrainerResource.pipes: s3"),
    (TrainerResource(launcher="k8s", pipes="s3", k8s=K8sTrainerConfig(image="i")), "/tmp/ckpts",
     "needs an s3:// checkpoint store"),
    (TrainerResource(launcher="k8s", pipes="s3", k8s=K8sTrainerConfig(image=" ")), STORE,
     "k8s.image is empty"),
    (TrainerResource(launcher="k8s", pipes="s3", k8s=K8sTrainerConfig(image="i"),
                     extra_env={"AWS_SECRET_ACCESS_KEY": SECRET}), STORE,
     "name it in TrainerResource.k8s.aws_secret"),
])
def test_a_pod_launch_that_cannot_work_is_refused_before_any_pod_saying_what_to_set(
        trainer, store_uri, says):
    reg = _reg("bad", {"task": "trainer.tasks.toy:build"})
    with pytest.raises(TrainerStartError, match=says):
        attempt_trainer(_context(dg.DagsterInstance.ephemeral()), reg, trainer, store_uri)


def test_a_pod_needs_positive_sizes_per_rank():
    with pytest.raises(Exception, match="cpu_per_rank"):
        K8sTrainerConfig(image="i", cpu_per_rank=0)


def test_a_local_trainer_is_left_as_configured():
    trainer = TrainerResource(grace_period_seconds=5.0)
    reg = _reg("local", {"task": "trainer.tasks.toy:build"})
    instance = _instance_with_saves("local", [60.0])
    assert attempt_trainer(_context(instance), reg, trainer, "/tmp/ckpts") is trainer


def _pod(terminated: int | None = None, waiting: str | None = None, phase: str = "Running"):
    state = k8s.V1ContainerState(
        terminated=k8s.V1ContainerStateTerminated(exit_code=terminated)
        if terminated is not None else None,
        waiting=k8s.V1ContainerStateWaiting(reason=waiting, message="no such Secret")
        if waiting else None)
    status = k8s.V1ContainerStatus(name="trainer", image="i", image_id="", ready=False,
                                   restart_count=0, state=state)
    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name="p"),
                     status=k8s.V1PodStatus(phase=phase, container_statuses=[status]))


def test_a_deleted_pod_whose_trainer_committed_and_exited_143_is_a_preemption():
    watch = _Watch()
    assert watch.exit_code(_pod()) is None
    assert Outcome.of_exit(watch.exit_code(_pod(terminated=143))) is Outcome.PREEMPTED


def test_a_pod_gone_before_its_status_was_seen_is_preempted_only_if_its_trainer_said_stopping():
    got: list = []
    watch = _Watch()
    watch.feed([to_message(Progress(step=4))], got.extend)
    assert Outcome.of_exit(watch.exit_code(None)) is Outcome.KILLED_BY_SIGNAL
    watch.feed([to_message(Progress(step=4)), to_message(Stopped(step=5, signal="SIGTERM"))],
               got.extend)
    assert len(got) == 2  # every message handed on once
    assert watch.exit_code(None) == Outcome.PREEMPTED.exit_code
    assert watch.exit_code(_pod(terminated=KILLED)) == KILLED


def test_a_container_that_can_never_start_is_bad_input_naming_the_reason():
    with pytest.raises(TrainerStartError, match="CreateContainerConfigError: no such Secret"):
        _Watch().exit_code(_pod(waiting="CreateContainerConfigError"))


class _Refusing:
    """A Kubernetes API that answers every call with one HTTP status."""

    def __init__(self, status: int) -> None:
        self.status = status

    def _fail(self, *_a, **_kw):
        raise ApiException(status=self.status, reason="as told")

    read_namespaced_pod = create_namespaced_pod = _fail


def test_a_refused_pod_is_bad_input_saying_what_to_grant_and_an_api_hiccup_is_waited_out():
    plan = SimpleNamespace(name="p", namespace="training")
    with pytest.raises(TrainerStartError, match="give the run worker's identity create/get/delete"):
        _create(_Refusing(403), plan, body=None)
    with pytest.raises(TrainerStartError, match="refused to read pod training/p: 403"):
        _read(_Refusing(403), plan, None)
    assert _Watch().exit_code(_read(_Refusing(503), plan, None)) is None  # still running
    assert _read(_Refusing(404), plan, None) is None  # gone


def test_a_run_on_several_nodes_is_no_longer_refused_its_pod_is_one_node_of_the_job(store, tmp_path):
    reg = _reg("two-nodes", {"task": "trainer.tasks.toy:build",
                             "distributed": {"nproc_per_node": 2, "nnodes": 2,
                                             "rdzv_endpoint": "node0:29400"}})
    trainer = _trainer()
    launch = task_launch(reg, _told(reg), base_env(trainer, store.aws_env()), trainer, tmp_path)
    pod = _manifest(_plan(launch, reg, trainer))
    (container,) = pod["spec"]["containers"]
    # Sized for this node's two ranks; the Job (test_k8s_job.py) runs it once per node.
    assert container["resources"]["limits"] == {"cpu": "2000m", "memory": "8192Mi"}
    assert container["command"][:3] == ["python", "-m", "ckpt_trainer.ranks"]
