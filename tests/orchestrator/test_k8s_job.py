"""An attempt on several nodes under `launcher: k8s`, at the spec level: the indexed Job of a
pod per node and the headless Service they meet through, as the API server would receive
them (the pod template merged by dagster-k8s's `build_pod_body`); each node's end read from
fake pod statuses and the attempt's end as the worst node's (`trainer.ranks.world.attempt_exit`);
the API's refusals as bad input and the teardown, through a fake of the API (fast: no
cluster, no process)."""

from __future__ import annotations

import json
import logging
import math
import threading
from types import SimpleNamespace

import dagster as dg
import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from ckpt_assets.attempt.command import AttemptIds, base_env, command_launch, contract, task_launch
from ckpt_assets.attempt.errors import TrainerStartError
from ckpt_assets.attempt.k8s_job import (
    DNS_WAIT_CONTAINER,
    INDEX_KEY,
    JOB_LABEL,
    NodeEnds,
    job_over,
    job_plan,
    node_command,
    nodes_exit,
)
from ckpt_assets.attempt.k8s_launch import KILLED, _Nodes, _Watch
from ckpt_assets.attempt.k8s_pod import (
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
from trainer.process.contract import RANKS_LAUNCHER, Env, Stopped, to_message
from trainer.ranks.world import attempt_exit
from trainer.storage import open_store

SECRET = "s3cr3t-never-in-a-job-spec"
PIPES_ENV = {"DAGSTER_PIPES_CONTEXT": "ctx", "DAGSTER_PIPES_MESSAGES": "msgs"}
STORE = "s3://team-bucket/ckpts"
POD_NAME = "dagster-0123456789abcdef01-model-checkpoint-4242424242"
PREEMPTED, LOST, BUG = (Outcome.PREEMPTED.exit_code, Outcome.RANK_LOST.exit_code,
                        Outcome.USER_CODE_ERROR.exit_code)


def _store() -> CheckpointStore:
    return CheckpointStore(uri=STORE, endpoint_url="http://s3.internal:9000",
                           aws_access_key_id="AKIAEXAMPLE", aws_secret_access_key=SECRET)


def _trainer(**k8s_fields) -> TrainerResource:
    cfg = K8sTrainerConfig(**{"image": "registry.local/ckpt:1", "aws_secret": "ckpt-aws",
                              "namespace": "training", **k8s_fields})
    return TrainerResource(launcher="k8s", pipes="s3", k8s=cfg)


def _reg(run: str, raw: dict) -> Registration:
    config = config_from_dict({"run": run, "experiment": "exp", **raw})
    return Registration(run, "exp", config, f"{STORE}/exp/{run}/config.json", "0" * 64)


def _attempt_trainer(reg: Registration, trainer: TrainerResource, saves: list[float]):
    instance = dg.DagsterInstance.ephemeral()
    for i, s in enumerate(saves):
        instance.report_runless_asset_event(dg.AssetObservation(
            MODEL_CHECKPOINT_KEY, partition=reg.run,
            metadata={"event": CHECKPOINT, "name": f"step-{i}", "save_seconds": s}))
    context = SimpleNamespace(instance=instance, log=logging.getLogger("test_k8s_job"))
    return attempt_trainer(context, reg, trainer, STORE)


def _told(reg: Registration):
    ids = AttemptIds(2, "dagster-run-1", "dagster-root-1", "abc123")
    return contract(reg, STORE, ids, DatasetRecord(kind="uri", uri="s3://team-bucket/d.pt",
                                                   version="v1"))


def _job_plan(launch, reg, trainer, name: str = POD_NAME):
    cfg = k8s_config(trainer, STORE)
    grace = termination_grace(trainer.grace_period_seconds, (), cfg.grace_margin_seconds)
    pod = pod_plan(launch, reg, trainer, cfg, name, grace)
    return job_plan(pod, reg.config.distributed.nnodes, reg.run, cfg)


def _two_node_task(tmp_path, **k8s_fields):
    reg = _reg("two-nodes", {"task": "trainer.tasks.toy:build",
                             "distributed": {"nproc_per_node": 2, "nnodes": 2}})
    trainer = _attempt_trainer(reg, _trainer(**k8s_fields), [40.2])
    told = _told(reg)
    launch = task_launch(reg, told, base_env(trainer, _store().aws_env()), trainer, tmp_path)
    return reg, told, _job_plan(launch, reg, trainer)


def _manifest(model) -> dict:
    """A model as the API server receives it (camelCase)."""
    return k8s.ApiClient().sanitize_for_serialization(model)


def test_a_two_node_run_is_an_indexed_job_of_a_pod_per_node_each_running_the_ranks_launcher_at_node_0s_endpoint(
        tmp_path):
    reg, told, plan = _two_node_task(tmp_path, cpu_per_rank=2, memory_gib_per_rank=1.5,
                                     gpus_per_rank=1)
    job = _manifest(plan.job(PIPES_ENV))
    name = plan.name
    spec, template = job["spec"], job["spec"]["template"]
    assert job["kind"] == "Job" and job["metadata"]["name"] == name
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 2, 2)
    pod = template["spec"]
    (container,) = pod["containers"]
    # One command for every node: the node rank is the rendezvous's, node 0's pod hosts it.
    assert container["command"] == [
        "python", "-m", RANKS_LAUNCHER, "--nproc-per-node", "2", "--nnodes", "2",
        "--grace-seconds", "81", "--heartbeat-timeout-s", "30", "--rdzv-id", "two-nodes",
        "--rdzv-endpoint", f"{name}-0.{name}:29400",
        "--", "python", "-m", "trainer", "--config", reg.config_uri, "--store", STORE,
        "--resume", "auto", "--log-level", "INFO"]
    assert pod["subdomain"] == name  # pod i is <job>-i.<service>
    assert template["metadata"]["labels"][JOB_LABEL] == name
    assert pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] == math.ceil(80.4 + 15.0)
    amounts = {"cpu": "4000m", "memory": "3072Mi", "nvidia.com/gpu": "2"}  # one node's ranks
    assert container["resources"] == {"requests": amounts, "limits": amounts}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env[Env.RUN] == "two-nodes" and env[Env.ATTEMPT] == "2"
    assert env["DAGSTER_PIPES_CONTEXT"] == "ctx" and Env.EXIT_WITH_PARENT not in env
    assert container["envFrom"] == [{"secretRef": {"name": "ckpt-aws"}}]
    assert SECRET not in json.dumps(job) and "AKIAEXAMPLE" not in json.dumps(job)
    assert template["metadata"]["annotations"]["ckpt-assets/run"] == "two-nodes"


def test_every_pod_waits_until_node_0s_name_resolves_before_torchrun_decides_who_hosts_the_rendezvous(
        tmp_path):
    _, _, plan = _two_node_task(tmp_path, gpus_per_rank=1)
    pod = _manifest(plan.job(PIPES_ENV))["spec"]["template"]["spec"]
    (wait,) = pod["initContainers"]
    assert wait["name"] == DNS_WAIT_CONTAINER and wait["image"] == "registry.local/ckpt:1"
    assert wait["command"][:2] == ["python", "-c"] and wait["command"][3] == plan.host
    # Guaranteed QoS holds (requests = limits on every container), and no GPU is taken.
    amounts = {"cpu": "2000m", "memory": "8192Mi"}
    assert wait["resources"] == {"requests": amounts, "limits": amounts}
    assert "env" not in wait  # told nothing: neither the contract nor Pipes


def test_the_job_fails_as_one_at_its_first_failed_or_disrupted_pod_and_never_replaces_a_pod(
        tmp_path):
    _, _, plan = _two_node_task(tmp_path)
    spec = _manifest(plan.job(PIPES_ENV))["spec"]
    assert (spec["backoffLimit"], spec["backoffLimitPerIndex"], spec["maxFailedIndexes"]) == (0, 0, 0)
    assert spec["podFailurePolicy"] == {"rules": [
        {"action": "FailJob",
         "onExitCodes": {"containerName": "trainer", "operator": "NotIn", "values": [0]}},
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]}


def test_the_rendezvous_service_is_headless_names_only_the_jobs_pods_and_is_deleted_with_the_job(
        tmp_path):
    _, _, plan = _two_node_task(tmp_path, rdzv_port=29555)
    svc = plan.service("uid-of-the-job")
    labels = _manifest(plan.job(PIPES_ENV))["spec"]["template"]["metadata"]["labels"]
    assert svc["metadata"]["name"] == plan.name  # the pods' subdomain
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"] == {JOB_LABEL: plan.name}
    assert svc["spec"]["selector"].items() <= labels.items()
    assert svc["spec"]["ports"] == [{"name": "rendezvous", "port": 29555}]
    assert svc["metadata"]["ownerReferences"] == [
        {"apiVersion": "batch/v1", "kind": "Job", "name": plan.name, "uid": "uid-of-the-job"}]
    assert plan.command[plan.command.index("--rdzv-endpoint") + 1] == f"{plan.host}:29555"


def test_a_command_run_naming_its_own_endpoint_meets_at_node_0s_pod_and_its_own_argv_is_untouched(
        tmp_path):
    reg = _reg("cmd-nodes", {"command": ["python", "train.py", "--rdzv-endpoint", "mine"],
                             "distributed": {"nproc_per_node": 1, "nnodes": 4,
                                             "rdzv_endpoint": "node0.example:29400"}})
    trainer = _trainer()
    repo = CheckpointRepo(open_store(str(tmp_path)), "exp", "cmd-nodes")
    launch = command_launch(reg, repo, _told(reg), base_env(trainer, {}), trainer,
                            logging.getLogger("test_k8s_job"))
    plan = _job_plan(launch, reg, trainer)
    cut = plan.command.index("--")
    assert "node0.example:29400" not in plan.command
    assert plan.command[:cut].count("--rdzv-endpoint") == 1
    assert plan.command[cut:] == ["--", "python", "train.py", "--rdzv-endpoint", "mine"]
    assert plan.nodes == 4


def test_local_nodes_become_the_jobs_rendezvous_and_a_command_not_under_the_launcher_is_refused():
    argv = ["python", "-m", RANKS_LAUNCHER, "--nproc-per-node", "1", "--nnodes", "2",
            "--grace-seconds", "20", "--local-nodes", "--rdzv-id", "r", "--", "python", "t.py"]
    assert node_command(argv, "r", "j-0.j:29400") == [
        "python", "-m", RANKS_LAUNCHER, "--nproc-per-node", "1", "--nnodes", "2",
        "--grace-seconds", "20", "--rdzv-id", "r", "--rdzv-endpoint", "j-0.j:29400",
        "--", "python", "t.py"]
    with pytest.raises(TrainerStartError, match="report this as a bug"):
        node_command(["python", "t.py"], "r", "j-0.j:29400")


def test_the_job_name_leaves_room_in_every_pod_hostname_for_the_largest_index(tmp_path):
    reg = _reg("many", {"task": "trainer.tasks.toy:build", "batch_size": 1024,
                        "distributed": {"nproc_per_node": 1, "nnodes": 1024}})
    trainer = _trainer()
    launch = task_launch(reg, _told(reg), base_env(trainer, {}), trainer, tmp_path)
    plan = _job_plan(launch, reg, trainer, name="dagster-" + "a" * 60)
    assert len(f"{plan.name}-1023") <= 63 and not plan.name.endswith("-")


def test_a_run_on_one_node_keeps_its_single_pod(tmp_path):
    reg = _reg("one-node", {"task": "trainer.tasks.toy:build",
                            "distributed": {"nproc_per_node": 2}})
    trainer = _trainer()
    launch = task_launch(reg, _told(reg), base_env(trainer, {}), trainer, tmp_path)
    cfg = k8s_config(trainer, STORE)
    pod = pod_plan(launch, reg, trainer, cfg, POD_NAME, termination_grace(20.0, (), 15.0))
    assert "--rdzv-endpoint" not in pod.command and "subdomain" not in pod.spec
    assert JOB_LABEL not in pod.meta["labels"]


# -- each node's end, from fake pod statuses ----------------------------------------------


def _pod(index: int, exit_code: int | None = None, phase: str = "Running",
         waiting: str | None = None, init_waiting: str | None = None,
         init_exit: int | None = None):
    def status(name, reason, code):
        state = k8s.V1ContainerState(
            terminated=k8s.V1ContainerStateTerminated(exit_code=code) if code is not None else None,
            waiting=k8s.V1ContainerStateWaiting(reason=reason, message="bad image")
            if reason else None)
        return k8s.V1ContainerStatus(name=name, image="i", image_id="", ready=False,
                                     restart_count=0, state=state)

    meta = k8s.V1ObjectMeta(name=f"job-{index}-abcde", annotations={INDEX_KEY: str(index)})
    return k8s.V1Pod(metadata=meta, status=k8s.V1PodStatus(
        phase=phase, container_statuses=[status("trainer", waiting, exit_code)],
        init_container_statuses=[status(DNS_WAIT_CONTAINER, init_waiting, init_exit)]))


def _job(*conditions: str):
    return k8s.V1Job(metadata=k8s.V1ObjectMeta(name="job"), status=k8s.V1JobStatus(
        conditions=[k8s.V1JobCondition(type=c, status="True") for c in conditions]))


def test_the_attempt_ends_when_the_last_node_ends_and_every_node_exiting_0_is_success():
    ends = NodeEnds(nodes=2, settle_s=30.0)
    assert not ends.see(job_over(_job()), [], now=0.0)  # the Job has no pods yet
    assert not ends.see(job_over(_job()), [_pod(0), _pod(1)], now=1.0)
    assert not ends.see(job_over(_job()), [_pod(0, 0, "Succeeded"), _pod(1)], now=2.0)
    assert ends.see(job_over(_job("Complete")), [_pod(0, 0, "Succeeded"),
                                                 _pod(1, 0, "Succeeded")], now=3.0)
    assert ends.exit_code(stopping=False) == Outcome.SUCCESS.exit_code


def test_once_a_node_failed_the_others_get_their_grace_to_end_then_the_attempt_ends_as_the_worst_node():
    ends = NodeEnds(nodes=3, settle_s=30.0)
    pods = [_pod(0), _pod(1, BUG, "Failed"), _pod(2)]
    assert not ends.see(job_over(_job("FailureTarget")), pods, now=10.0)
    assert not ends.see(True, [_pod(0, LOST, "Failed"), pods[1], _pod(2)], now=39.0)
    assert ends.see(True, [_pod(0, LOST, "Failed"), pods[1], _pod(2)], now=40.0)  # grace over
    assert ends.codes == {0: LOST, 1: BUG}
    # The bug on node 1 is the cause: node 0 only lost its peer, node 2 was never seen to end.
    assert ends.exit_code(stopping=False) == BUG


def test_a_preempted_node_whose_peers_committed_the_same_stop_is_a_preemption():
    ends = NodeEnds(nodes=2, settle_s=30.0)
    # The kubelet's SIGTERM to node 1; every rank agrees on the stop and exits 143.
    assert ends.see(True, [_pod(0, PREEMPTED, "Failed"), _pod(1, PREEMPTED, "Failed")], now=5.0)
    assert Outcome.of_exit(ends.exit_code(stopping=True)) is Outcome.PREEMPTED


def test_a_node_gone_before_its_status_was_seen_reads_as_one_pod_gone_unless_another_names_the_cause():
    ends = NodeEnds(nodes=2, settle_s=30.0)
    assert not ends.see(False, [_pod(0), _pod(1)], now=0.0)
    # Node 1's pod vanished (deleted, its status never read); node 0 lost its peer.
    assert ends.see(True, [_pod(0, LOST, "Failed")], now=1.0)
    assert ends.exit_code(stopping=False) == KILLED
    assert nodes_exit({0: BUG}, 2, stopping=False) == BUG  # deleted after the bug by the Job
    assert nodes_exit({0: 0}, 2, stopping=False) == KILLED


def test_a_job_deleted_with_its_pods_ends_the_attempt_as_a_pod_deleted_does():
    ends = NodeEnds(nodes=2, settle_s=30.0)
    assert not ends.see(job_over(_job()), [_pod(0), _pod(1)], now=0.0)
    assert ends.see(job_over(None), [], now=1.0)
    assert ends.exit_code(stopping=True) == PREEMPTED


@pytest.mark.parametrize("codes,popen", [
    ({0: LOST, 1: BUG}, {0: LOST, 1: BUG}),
    ({0: BUG, 1: KILLED}, {0: BUG, 1: -9}),  # a container's 137 is a SIGKILL, as a rank's -9
    ({0: LOST, 1: KILLED}, {0: LOST, 1: -9}),
    ({0: PREEMPTED, 1: LOST}, {0: PREEMPTED, 1: LOST}),
    ({0: 0, 1: LOST}, {1: LOST}),
    ({0: PREEMPTED, 1: PREEMPTED}, {0: PREEMPTED, 1: PREEMPTED}),
    ({0: 2, 1: LOST, 2: PREEMPTED}, {0: 2, 1: LOST, 2: PREEMPTED}),
])
def test_the_attempts_end_is_the_worst_nodes_by_the_rule_the_ranks_launcher_applies_to_ranks(
        codes, popen):
    assert nodes_exit(codes, len(codes), stopping=False) == attempt_exit(popen)


def test_a_node_killed_is_the_attempts_end_whatever_its_peers_then_reported():
    assert Outcome.of_exit(nodes_exit({0: BUG, 1: KILLED}, 2, False)) is Outcome.KILLED_BY_SIGNAL
    assert nodes_exit({0: 0, 1: 0}, 2, stopping=False) == Outcome.SUCCESS.exit_code


def test_a_node_whose_image_can_never_start_is_bad_input_naming_the_reason():
    with pytest.raises(TrainerStartError, match="rendezvous-dns: InvalidImageName: bad image"):
        NodeEnds(2, 30.0).see(False, [_pod(0), _pod(1, init_waiting="InvalidImageName")], 0.0)
    # An image whose python the DNS wait cannot run: the trainer never started, no kill.
    with pytest.raises(TrainerStartError, match="init container rendezvous-dns exited 127"):
        NodeEnds(2, 30.0).see(False, [_pod(0), _pod(1, phase="Failed", init_exit=127)], 0.0)


# -- the Job through a fake of the API ------------------------------------------------------


class _FakeApi:
    """The Kubernetes API of one namespace, as far as `_Nodes` uses it."""

    def __init__(self, refuse: dict[str, int] | None = None):
        self.refuse, self.calls, self.job, self.pods = refuse or {}, [], _job(), []

    def _answer(self, verb: str, *args, **kwargs):
        self.calls.append((verb, args, kwargs))
        if verb in self.refuse:
            raise ApiException(status=self.refuse[verb], reason="as told")

    def create_namespaced_job(self, ns, body):
        self._answer("create_job", ns, body)
        return SimpleNamespace(metadata=SimpleNamespace(uid="uid-1"))

    def create_namespaced_service(self, ns, body):
        self._answer("create_service", ns, body)

    def read_namespaced_job(self, name, ns):
        self._answer("read_job", name, ns)
        return self.job

    def list_namespaced_pod(self, ns, label_selector):
        self._answer("list_pods", ns, label_selector)
        return SimpleNamespace(items=self.pods)

    def read_namespaced_pod_log(self, *args, **kwargs):
        raise ApiException(status=404, reason="gone")  # no output to follow here

    def delete_collection_namespaced_pod(self, ns, **kwargs):
        self._answer("delete_pods", ns, **kwargs)

    def delete_namespaced_job(self, name, ns, **kwargs):
        self._answer("delete_job", name, ns, **kwargs)

    def delete_namespaced_service(self, name, ns):
        self._answer("delete_service", name, ns)


def _nodes(tmp_path, api: _FakeApi) -> _Nodes:
    _, _, plan = _two_node_task(tmp_path)
    context = SimpleNamespace(log=logging.getLogger("test_k8s_job"))
    done = threading.Event()
    done.set()
    return _Nodes(SimpleNamespace(core_api=api, batch_api=api), plan, _Watch(), context, done)


def test_the_job_is_created_before_its_service_which_it_owns_and_its_end_is_read_from_its_pods(
        tmp_path):
    api = _FakeApi()
    nodes = _nodes(tmp_path, api)
    nodes.create(PIPES_ENV)
    (_, (_, job), _), (_, (_, svc), _) = api.calls
    assert [c[0] for c in api.calls] == ["create_job", "create_service"]
    assert job.spec.completion_mode == "Indexed"
    assert svc["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    api.pods = [_pod(0), _pod(1)]
    assert nodes.end(None) is None
    api.job, api.pods = _job("Failed"), [_pod(0, KILLED, "Failed"), _pod(1, LOST, "Failed")]
    assert nodes.end(None) == KILLED
    assert ("list_pods", ("training", nodes.plan.selector), {}) in api.calls


def test_a_refused_job_is_bad_input_saying_what_to_grant_and_a_refused_service_takes_the_job_with_it(
        tmp_path):
    with pytest.raises(TrainerStartError, match="create/get/delete on jobs"):
        _nodes(tmp_path, _FakeApi({"create_job": 403})).create(PIPES_ENV)
    api = _FakeApi({"create_service": 403})
    with pytest.raises(TrainerStartError, match="refused to create service training/"):
        _nodes(tmp_path, api).create(PIPES_ENV)
    assert [c[0] for c in api.calls][-3:] == ["delete_pods", "delete_job", "delete_service"]


def test_stopping_the_attempt_deletes_every_pod_with_the_grace_asked_for_then_the_job_and_service(
        tmp_path):
    api = _FakeApi()
    nodes = _nodes(tmp_path, api)
    nodes.delete(95)
    pods, job, svc = api.calls
    assert pods == ("delete_pods", ("training",),
                    {"label_selector": nodes.plan.selector, "grace_period_seconds": 95})
    assert job[0] == "delete_job" and job[2]["propagation_policy"] == "Background"
    assert svc == ("delete_service", (nodes.plan.name, "training"), {})


def test_an_api_hiccup_while_watching_the_job_is_waited_out_and_a_refusal_is_bad_input(tmp_path):
    assert _nodes(tmp_path, _FakeApi({"list_pods": 503})).end(None) is None
    with pytest.raises(TrainerStartError, match="refused to read job training/"):
        _nodes(tmp_path, _FakeApi({"read_job": 403})).end(None)


def test_a_stop_reported_by_the_trainer_makes_a_vanished_node_a_preemption(tmp_path):
    api = _FakeApi()
    nodes = _nodes(tmp_path, api)
    nodes.watch.feed([to_message(Stopped(step=5, signal="SIGTERM"))], lambda _m: None)
    api.pods = [_pod(0), _pod(1)]
    assert nodes.end(None) is None
    api.job, api.pods = None, []
    assert nodes.end(None) == PREEMPTED
