"""An attempt as a Kubernetes pod: the spec, built from the attempt's `TrainerCommand` alone.

`TrainerResource(launcher="k8s", k8s=K8sTrainerConfig(...))` runs each attempt's process
(`python -m trainer`, or the run's command, under `python -m ckpt_trainer.ranks` for several
ranks) as one pod started by dagster-k8s's `PipesK8sClient` (`ckpt_assets.attempt.k8s_launch`);
a run on several nodes runs this pod once per node, as an indexed Job
(`ckpt_assets.attempt.k8s_job`).
`attempt_trainer` reads the run's recorded save times (its checkpoint observations) into
the grace; the rest is pure: `pod_plan` turns the attempt's argv, environment and working
directory, the run's config and its recorded save times into a `PodPlan`, and
`PodPlan.body` merges it through dagster-k8s's own `build_pod_body`, as the client does.

* The pod shares no filesystem with the run worker: Pipes travel over S3, the checkpoints
  and the registered config are in an S3 store (refused otherwise).
* Its environment is the contract (`trainer.process.contract.LaunchEnv`) and the variables the run
  and the resource set, never the run worker's own; AWS credentials come from a named
  Secret (`envFrom`), never as plain values.
* Preemption is the pod's deletion: the kubelet sends SIGTERM, the trainer commits and
  exits 143 (`preempted`). `terminationGracePeriodSeconds` is above the run's slowest
  recorded save, so the commit finishes before the kubelet's SIGKILL.
* `restartPolicy: Never`: the sensors own resumes; a restarted container would be an
  attempt nobody counted.
* How a pod ended (`pod_end`): its container's exit status, read the same way for one pod
  and for each node's.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import dagster as dg
from pydantic import Field

from ckpt_assets.attempt.errors import TrainerStartError
from ckpt_assets.base.events import CHECKPOINT, partition_events
from trainer.process.contract import CONTRACT_NAMES, Env, PipesTransport

if TYPE_CHECKING:
    from ckpt_assets.attempt.command import TrainerCommand
    from ckpt_assets.base.registration import Registration

# The AWS variables that are credentials: a pod gets them from `K8sTrainerConfig.aws_secret`.
AWS_CREDENTIALS = frozenset({"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"})
# Where the store is (not who may read it): handed to the pod as plain values.
AWS_LOCATION = frozenset({"AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"})
# The run worker's own variables a launch carries that the pod keeps (the rest of its
# environment is the run worker's machine, not the pod's).
POD_KEEPS = frozenset({"PYTHONUNBUFFERED"}) | AWS_LOCATION
SAVES_LOOKED_AT = 50  # the run's newest checkpoints whose save times set the grace
SAVE_GRACE_FACTOR = 2  # the commit on SIGTERM may be slower than the run's typical save
SHM_VOLUME = "dshm"  # several ranks and DataLoader workers share tensors through /dev/shm
POD_WORKDIR = "/workspace"  # the trainer's cwd in the image unless working_directory is set
TRAINER_CONTAINER = "trainer"
KILLED = 128 + signal.SIGKILL  # a container's exit status after SIGKILL
# A container that cannot start for a reason no retry fixes: the config is wrong.
NEVER_STARTS = frozenset({"CreateContainerConfigError", "InvalidImageName", "ErrImageNeverPull"})
ENDED_UNSEEN = object()  # a pod that ended with no container status kept (evicted early)


class Launcher(StrEnum):
    """Where an attempt's process runs."""

    LOCAL = "local"  # a process group of the run worker
    K8S = "k8s"  # a Kubernetes pod (`K8sTrainerConfig`)


class K8sTrainerConfig(dg.Config):
    """The pod an attempt runs in (`TrainerResource.launcher: k8s`)."""

    image: str = Field(description="the trainer's image: ckpt-assets (and a command's code) "
                                   "installed, `python` on its PATH")
    namespace: str = Field(default="default", description="where the pods are created")
    service_account: str | None = Field(default=None, description="the pod's service account")
    aws_secret: str | None = Field(
        default=None, description="a Secret whose keys are AWS_ACCESS_KEY_ID and "
                                  "AWS_SECRET_ACCESS_KEY (envFrom); unset: the service "
                                  "account's own identity (IRSA, workload identity)")
    cpu_per_rank: float = Field(default=1.0, gt=0, description="cores per rank (request = limit)")
    memory_gib_per_rank: float = Field(default=4.0, gt=0, description="GiB per rank (request = limit)")
    gpus_per_rank: int = Field(default=0, ge=0, description="GPUs per rank (`gpu_resource`)")
    gpu_resource: str = Field(default="nvidia.com/gpu", description="the GPUs' resource name")
    node_selector: dict[str, str] = Field(default_factory=dict, description="pod nodeSelector")
    tolerations: list[dict[str, str]] = Field(default_factory=list, description="pod tolerations")
    image_pull_secrets: list[str] = Field(default_factory=list, description="Secret names")
    labels: dict[str, str] = Field(default_factory=dict, description="added to the pod's labels")
    grace_margin_seconds: float = Field(
        default=15.0, ge=0, description="added to the grace the ranks get: time for "
                                        "torchrun and the container to exit after the commit")
    kubeconfig_file: str | None = Field(default=None, description="default: in-cluster config "
                                        "inside a cluster, else ~/.kube/config")
    kube_context: str | None = Field(default=None, description="a kubeconfig context")
    poll_interval_seconds: float = Field(default=2.0, gt=0, description="how often the pod's "
                                         "status and the Pipes messages are read")
    rdzv_port: int = Field(default=29400, gt=0, lt=65536, description="distributed.nnodes "
                           "above 1: the port on node 0's pod where the nodes' c10d "
                           "rendezvous meets")


@dataclass(frozen=True)
class Grace:
    """How long a stopped attempt may take: `ranks` for the trainer to commit (and
    torchrun's `--grace-seconds`), `pod` for the kubelet's SIGKILL."""

    ranks: float
    pod: int


def termination_grace(configured: float, save_seconds: Iterable[float | None],
                      margin: float) -> Grace:
    """The configured grace, or twice the slowest recorded save if that is longer; the
    pod gets `margin` more, so torchrun's own exit never meets the kubelet's SIGKILL."""
    saves = [s for s in save_seconds if s is not None and math.isfinite(s)]
    ranks = max([configured, *(SAVE_GRACE_FACTOR * s for s in saves)])
    return Grace(ranks, math.ceil(ranks + margin))


def recorded_save_seconds(instance: dg.DagsterInstance, run: str) -> list[float]:
    """How long the run's newest checkpoints took to save, as their observations say."""
    return [float(md["save_seconds"]) for md, _ in partition_events(
        instance, run, CHECKPOINT, newest_first=True, limit=SAVES_LOOKED_AT)
        if isinstance(md.get("save_seconds"), int | float)]


def attempt_trainer(context, reg: Registration, trainer, store_uri: str):
    """`trainer` as this attempt uses it: in a pod, its grace is the measured one (twice
    the slowest recorded save, if above the configured grace), so that torchrun's
    `--grace-seconds` and the pod's grace both cover a commit; locally, unchanged."""
    try:
        Launcher(trainer.launcher)
    except ValueError:
        raise _bad(f"TrainerResource.launcher is {trainer.launcher!r}; use one of "
                   f"{', '.join(x.value for x in Launcher)}") from None
    if not trainer.in_pod:
        return trainer
    cfg = k8s_config(trainer, store_uri)
    grace = termination_grace(trainer.grace_period_seconds,
                              recorded_save_seconds(context.instance, reg.run),
                              cfg.grace_margin_seconds)
    if grace.ranks > trainer.grace_period_seconds:
        context.log.info(f"grace {grace.ranks:.0f}s (twice the slowest recorded save; "
                         f"configured {trainer.grace_period_seconds:.0f}s), pod {grace.pod}s")
    return trainer.model_copy(update={"grace_period_seconds": grace.ranks})


def _bad(message: str) -> Exception:
    return TrainerStartError(message)  # bad input, as any bad start


def k8s_config(trainer, store_uri: str) -> K8sTrainerConfig:
    """`trainer`'s (a TrainerResource's) pod settings, or one clear error naming what to
    set: a pod needs its image, Pipes over S3 and an S3 store (it shares no filesystem)."""
    if trainer.k8s is None:
        raise _bad("TrainerResource.launcher is k8s but TrainerResource.k8s is not set; give "
                   "it K8sTrainerConfig(image=...) or use launcher: local")
    if not trainer.k8s.image.strip():
        raise _bad("TrainerResource.k8s.image is empty; name the trainer's image")
    if trainer.pipes != PipesTransport.S3:
        raise _bad(f"launcher: k8s needs TrainerResource.pipes: s3 (it is {trainer.pipes!r}); "
                   "a pod cannot read the run worker's Pipes temp files")
    if urlparse(store_uri).scheme != "s3":
        raise _bad(f"launcher: k8s needs an s3:// checkpoint store (it is {store_uri!r}); a "
                   "pod cannot reach the run worker's disk")
    plain = AWS_CREDENTIALS & set(trainer.extra_env)
    if plain:
        raise _bad(f"TrainerResource.extra_env sets {', '.join(sorted(plain))}: a pod gets "
                   "credentials only from a Secret; name it in TrainerResource.k8s.aws_secret")
    return trainer.k8s


@dataclass(frozen=True)
class PodPlan:
    """One attempt's pod, before the Pipes bootstrap variables are known."""

    name: str
    namespace: str
    command: list[str]
    env: dict[str, str]
    meta: dict[str, Any]
    spec: dict[str, Any]  # camelCase, as in a manifest

    @property
    def grace_seconds(self) -> int:
        return self.spec["terminationGracePeriodSeconds"]

    def body(self, pipes_env: Mapping[str, str]):
        """The V1Pod, merged by dagster-k8s's `build_pod_body` as `PipesK8sClient.run` does:
        the Pipes bootstrap variables first, then the attempt's."""
        from dagster_k8s.pipes import build_pod_body

        return build_pod_body(pod_name=self.name, image=None, command=self.command,
                              env_vars={**pipes_env, **self.env}, base_pod_meta=self.meta,
                              base_pod_spec=self.spec)


def pod_env(launch: TrainerCommand, reg: Registration, trainer) -> dict[str, str]:
    """What the pod is told: the contract, the run's and the resource's variables, where
    the store is and the image's PYTHONPATH; not the run worker's own environment, no
    credentials, and no parent to exit with (the kubelet owns the pod's life)."""
    keep = CONTRACT_NAMES | POD_KEEPS | set(trainer.extra_env) | set(reg.config.env)
    env = {k: v for k, v in launch.env.items() if k in keep and k not in AWS_CREDENTIALS}
    env.pop(Env.EXIT_WITH_PARENT, None)
    if trainer.pythonpath:  # paths in the image; ckpt-assets itself is installed there
        env["PYTHONPATH"] = os.pathsep.join(trainer.pythonpath)
    return env


def _resources(cfg: K8sTrainerConfig, ranks: int) -> dict[str, Any]:
    """Requests equal to limits (Guaranteed QoS: the last to be evicted), per rank."""
    amounts = {"cpu": f"{math.ceil(cfg.cpu_per_rank * ranks * 1000)}m",
               "memory": f"{math.ceil(cfg.memory_gib_per_rank * ranks * 1024)}Mi"}
    if cfg.gpus_per_rank:
        amounts[cfg.gpu_resource] = str(cfg.gpus_per_rank * ranks)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _container(launch: TrainerCommand, cfg: K8sTrainerConfig, ranks: int) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": TRAINER_CONTAINER, "image": cfg.image, "workingDir": launch.cwd,
        "resources": _resources(cfg, ranks),
        "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}]}
    if cfg.aws_secret:
        container["envFrom"] = [{"secretRef": {"name": cfg.aws_secret}}]
    return container


def pod_plan(launch: TrainerCommand, reg: Registration, trainer, cfg: K8sTrainerConfig, name: str,
             grace: Grace) -> PodPlan:
    """The pod of one attempt, or of one of its nodes (`k8s_job.job_plan` makes it every
    node's): `launch`'s argv as the container's command (already under `python -m
    ckpt_trainer.ranks` when the run asks for several ranks), sized for
    `distributed.nproc_per_node` ranks, with `grace` before the kubelet's SIGKILL."""
    ranks = reg.config.distributed.nproc_per_node
    spec: dict[str, Any] = {
        "restartPolicy": "Never",  # the sensors own resumes
        "terminationGracePeriodSeconds": grace.pod,
        "containers": [_container(launch, cfg, ranks)],
        "volumes": [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}],
    }
    if cfg.service_account:
        spec["serviceAccountName"] = cfg.service_account
    if cfg.node_selector:
        spec["nodeSelector"] = dict(cfg.node_selector)
    if cfg.tolerations:
        spec["tolerations"] = [dict(t) for t in cfg.tolerations]
    if cfg.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in cfg.image_pull_secrets]
    # Run names are free text: they go in annotations; labels carry only safe values.
    meta = {"labels": {**cfg.labels, "ckpt-assets/attempt": launch.env[Env.ATTEMPT]},
            "annotations": {"ckpt-assets/run": reg.run, "ckpt-assets/experiment": reg.experiment}}
    return PodPlan(name, cfg.namespace, list(launch.argv), pod_env(launch, reg, trainer), meta,
                   spec)


def pod_end(pod) -> Any:
    """How `pod` (a V1Pod) ended: its trainer container's exit status, ENDED_UNSEEN when it
    ended with no status kept (evicted before one was recorded), None while it runs; a
    container that can never start is bad input."""
    status = pod.status
    for c in [*(status.init_container_statuses or []), *(status.container_statuses or [])]:
        waiting = c.state.waiting if c.state else None
        if waiting is not None and waiting.reason in NEVER_STARTS:
            raise _bad(f"pod {pod.metadata.name} cannot start its container {c.name}: "
                       f"{waiting.reason}: {waiting.message}; fix TrainerResource.k8s (image, "
                       "Secret names)")
    for c in status.init_container_statuses or []:  # the trainer never started: not a kill
        ended = c.state.terminated if c.state else None
        if ended is not None and ended.exit_code != 0:
            raise _bad(f"pod {pod.metadata.name}: its init container {c.name} exited "
                       f"{ended.exit_code} before the trainer started ({ended.reason}); check "
                       "the image (its python) and TrainerResource.k8s")
    for c in status.container_statuses or []:
        if c.state and c.state.terminated is not None:
            return c.state.terminated.exit_code
    if status.phase == "Succeeded":
        return 0
    return ENDED_UNSEEN if status.phase == "Failed" else None
