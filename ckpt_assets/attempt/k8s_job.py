"""An attempt on several nodes as one indexed Job: a pod per node, meeting at node 0's.

A run whose `distributed.nnodes` is above 1 runs under `launcher: k8s` as an Indexed Job of
`nnodes` pods (`completions` = `parallelism` = nnodes), each the pod `k8s_pod.pod_plan`
builds for one node (its `nproc_per_node` ranks and their resources, the grace, the
environment, no credentials), merged by dagster-k8s's `build_pod_body`, with:

* a headless Service named as the Job, selecting its pods, and the pods' `subdomain` set to
  it, so pod i is `<job>-i.<job>` in the namespace's DNS: every node reaches node 0's pod by
  a name known before the pod exists. `publishNotReadyAddresses`: the names resolve as soon
  as the pods have addresses, not once they are "ready" (a trainer has no readiness probe);
* one command on every node: `python -m ckpt_trainer.ranks --nproc-per-node M --nnodes N
  --rdzv-id <run> --rdzv-endpoint <job>-0.<job>:<rdzv_port>` (torchrun's restarts off, as on
  one node). The launcher takes no node rank, and torchrun's `--node-rank` only serves its
  static rendezvous: the c10d rendezvous numbers the nodes itself, in the order of their
  names (`<job>-0` first, so node 0's pod holds rank 0; the completion index is the node
  rank for up to 10 nodes, string order beyond). The Job controller sets
  `JOB_COMPLETION_INDEX` in each pod;
* an init container that waits until node 0's name resolves. torchrun decides once, as it
  starts, whether its node hosts the rendezvous's store, by resolving the endpoint: node 0
  asking before the DNS knows its name would wait as a client of a store nobody hosts, and
  the attempt would fail as a bug;
* failure as one: `backoffLimit` 0, `backoffLimitPerIndex` 0 with `maxFailedIndexes` 0, and a
  `podFailurePolicy` that fails the Job on any non-zero exit of the trainer and on any
  disruption (a preemption is a pod's deletion). The Job controller then deletes the other
  pods: their ranks get SIGTERM and commit the step they agree on, or find a peer gone.

The attempt's exit status is the worst node's (`nodes_exit`): `trainer.ranks.world.attempt_exit`
over the nodes' container statuses, as `trainer.ranks.nodes` does over nodes on one machine (a
container's 128+N read as the signal N, as a process's -N is: a node killed wins). A
node whose end was never seen (its pod deleted before its status was read) counts as one
pod gone does (143 if the trainer reported stopping, else 137), unless another node's
status already names the cause: the Job controller deleted it after that node failed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_assets.attempt.errors import TrainerStartError
from ckpt_assets.attempt.k8s_pod import (
    ENDED_UNSEEN,
    KILLED,
    TRAINER_CONTAINER,
    K8sTrainerConfig,
    PodPlan,
    pod_end,
)
from trainer.base.outcomes import STOP_SIGNALS, Outcome, signal_of
from trainer.process.contract import RANKS_LAUNCHER
from trainer.ranks.world import ECHOES, attempt_exit

JOB_LABEL = "ckpt-assets/job"  # on every pod of the Job: the Service's selector and the watch's
INDEX_KEY = "batch.kubernetes.io/job-completion-index"  # the pod's annotation (and label)
MAX_HOSTNAME = 63  # a pod's hostname, `<job>-<index>`, is one DNS label
DNS_WAIT_CONTAINER = "rendezvous-dns"
# The Job's conditions that say it is over, or about to be once its pods have ended.
JOB_OVER = frozenset({"Complete", "Failed", "FailureTarget", "SuccessCriteriaMet"})
# Run by the init container with the image's Python (stdlib only): until the name resolves.
WAIT_FOR_NAME = """\
import socket, sys, time
while True:
    try:
        socket.getaddrinfo(sys.argv[1], None)
        break
    except OSError:
        time.sleep(1)
"""


@dataclass(frozen=True)
class JobPlan:
    """One attempt's Job and Service, before the Pipes bootstrap variables are known."""

    pod: PodPlan  # one node's pod; its name is the Job's, its command every node's
    nodes: int
    port: int

    @property
    def name(self) -> str:
        return self.pod.name

    @property
    def namespace(self) -> str:
        return self.pod.namespace

    @property
    def grace_seconds(self) -> int:
        return self.pod.grace_seconds

    @property
    def command(self) -> list[str]:
        return self.pod.command

    @property
    def host(self) -> str:
        """Node 0's pod, as every pod of the Job resolves it (the namespace is searched)."""
        return f"{self.name}-0.{self.name}"

    @property
    def selector(self) -> str:
        return f"{JOB_LABEL}={self.name}"

    def manifest(self, pipes_env: Mapping[str, str]) -> dict[str, Any]:
        """The Job, camelCase, its pod template merged by dagster-k8s's `build_pod_body`."""
        from kubernetes.client import ApiClient

        pod = ApiClient().sanitize_for_serialization(self.pod.body(pipes_env))
        trainer = pod["spec"]["containers"][0]
        wait = {"name": DNS_WAIT_CONTAINER, "image": trainer["image"],
                "command": [self.command[0], "-c", WAIT_FOR_NAME, self.host],
                # cpu and memory as the trainer's, requests = limits: the pod stays in the
                # Guaranteed QoS class, and asks for no more (init containers run before).
                "resources": {k: {r: v for r, v in amounts.items() if r in ("cpu", "memory")}
                              for k, amounts in trainer["resources"].items()}}
        labels = pod["metadata"]["labels"]
        annotations = pod["metadata"].get("annotations", {})
        never = {"containerName": TRAINER_CONTAINER, "operator": "NotIn", "values": [0]}
        return {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": self.name, "labels": labels, "annotations": annotations},
            "spec": {
                "completionMode": "Indexed", "completions": self.nodes,
                "parallelism": self.nodes,
                # No pod is ever replaced: the sensors own resumes, and a node restarted
                # alone could not rejoin a rendezvous its peers have left.
                "backoffLimit": 0, "backoffLimitPerIndex": 0, "maxFailedIndexes": 0,
                "podFailurePolicy": {"rules": [
                    {"action": "FailJob", "onExitCodes": never},
                    {"action": "FailJob",
                     "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]},
                "template": {"metadata": {"labels": labels, "annotations": annotations},
                             "spec": {**pod["spec"], "subdomain": self.name,
                                      "initContainers": [wait]}}}}

    def job(self, pipes_env: Mapping[str, str]):
        """The V1Job (`manifest`), as dagster-k8s builds its own models from camelCase."""
        from dagster_k8s.models import k8s_model_from_dict, k8s_snake_case_dict
        from kubernetes.client import V1Job

        return k8s_model_from_dict(V1Job, k8s_snake_case_dict(V1Job, self.manifest(pipes_env)))

    def service(self, job_uid: str | None = None) -> dict[str, Any]:
        """The headless Service that names the Job's pods; owned by the Job (`job_uid`),
        so the cluster deletes it with the Job even if the run worker never does."""
        meta: dict[str, Any] = {"name": self.name, "labels": {JOB_LABEL: self.name}}
        if job_uid:
            meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job",
                                        "name": self.name, "uid": job_uid}]
        return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
                "spec": {"clusterIP": "None", "selector": {JOB_LABEL: self.name},
                         "publishNotReadyAddresses": True,
                         "ports": [{"name": "rendezvous", "port": self.port}]}}


def node_command(argv: list[str], run: str, endpoint: str) -> list[str]:
    """`argv` (`command.under_ranks`'s, as on one machine) with the Job's rendezvous: node
    0's pod as `--rdzv-endpoint`, in place of `--local-nodes` (every node on one machine)
    or of an endpoint the run named (a host outside the Job, which its pods cannot own)."""
    if "--" not in argv or argv[1:3] != ["-m", RANKS_LAUNCHER]:
        raise TrainerStartError(f"a run on several nodes starts under python -m {RANKS_LAUNCHER}, "
                                f"but the attempt's command is {argv[:3]}; report this as a "
                                "bug of ckpt-assets")
    cut = argv.index("--")
    head = [arg for arg in argv[:cut] if arg != "--local-nodes"]
    if "--rdzv-endpoint" in head:
        at = head.index("--rdzv-endpoint")
        del head[at:at + 2]
    if "--rdzv-id" not in head:
        head += ["--rdzv-id", run]
    return [*head, "--rdzv-endpoint", endpoint, *argv[cut:]]


def job_plan(pod: PodPlan, nodes: int, run: str, cfg: K8sTrainerConfig) -> JobPlan:
    """`nodes` pods like `pod`, meeting at node 0's on `cfg.rdzv_port`."""
    # `<job>-<index>` is every pod's hostname: one DNS label, whatever the index.
    name = pod.name[:MAX_HOSTNAME - len(f"-{nodes - 1}")].rstrip("-")
    meta = {**pod.meta, "labels": {**pod.meta.get("labels", {}), JOB_LABEL: name}}
    command = node_command(pod.command, run, f"{name}-0.{name}:{cfg.rdzv_port}")
    node = PodPlan(name, pod.namespace, command, pod.env, meta, pod.spec)
    return JobPlan(node, nodes, cfg.rdzv_port)


def completion_index(pod) -> int | None:
    """Which node `pod` (a V1Pod of the Job) is, as the Job controller numbered it."""
    meta = pod.metadata
    raw = (meta.annotations or {}).get(INDEX_KEY) or (meta.labels or {}).get(INDEX_KEY)
    return int(raw) if raw is not None and str(raw).isdigit() else None


def job_over(job) -> bool:
    """Is the Job (a V1Job, None once it is gone) over, or failing?"""
    if job is None or job.metadata.deletion_timestamp is not None:
        return True
    return any(c.type in JOB_OVER and c.status == "True" for c in job.status.conditions or [])


@dataclass
class NodeEnds:
    """Each node's end as the run worker has seen it, poll after poll (`see`)."""

    nodes: int
    settle_s: float  # once one node has ended badly: how long the others may take (grace)
    codes: dict[int, int] = field(default_factory=dict)  # node -> its container's status
    seen: set[int] = field(default_factory=set)  # nodes whose pod was ever listed
    alive: dict[int, str] = field(default_factory=dict)  # running at the last poll: pod names
    settle_by: float | None = None

    def see(self, over: bool, pods: Iterable[Any], now: float) -> bool:
        """This poll's Job state (`job_over`) and pods; True once the attempt has ended:
        every node ended, or one ended badly (or the Job is over) and the others have ended
        too or had their grace."""
        self.alive = {}
        for pod in pods:
            i = completion_index(pod)
            if i is None or i in self.codes:
                continue
            self.seen.add(i)
            end = pod_end(pod)
            if end is None:
                self.alive[i] = pod.metadata.name
            elif end is not ENDED_UNSEEN:
                self.codes[i] = end
        if len(self.codes) == self.nodes:
            return True
        vanished = self.seen - set(self.codes) - set(self.alive)
        if not (over or vanished or any(self.codes.values())):
            return False
        if self.settle_by is None:
            self.settle_by = now + self.settle_s
        return not self.alive or now >= self.settle_by

    def exit_code(self, stopping: bool) -> int:
        return nodes_exit(self.codes, self.nodes, stopping)


def nodes_exit(codes: Mapping[int, int], nodes: int, stopping: bool) -> int:
    """The attempt's exit status from its nodes' (node -> container exit status; a node
    missing was never seen to end): the worst node's, by `trainer.ranks.world.attempt_exit`."""
    failed = {i: c for i, c in codes.items() if c != 0}
    if not any(Outcome.of_exit(c) not in ECHOES for c in failed.values()):
        # Nothing seen names a cause: a node gone unseen is read as one pod gone is.
        gone = Outcome.PREEMPTED.exit_code if stopping else KILLED
        failed |= {i: gone for i in range(nodes) if i not in codes}
    if not failed:
        return Outcome.SUCCESS.exit_code
    return attempt_exit({i: _as_popen(c) for i, c in failed.items()})


def _as_popen(code: int) -> int:
    """A container's 128+N for a signal as Popen's -N, the form `attempt_exit` ranks a kill
    by: a node killed (the OOM killer, the kubelet) is the cause, whatever its peers then
    reported; a stop (143) stays what it is, an echo."""
    sig = signal_of(code)
    return -sig if code > 128 and sig is not None and sig not in STOP_SIGNALS else code
