"""An attempt's process as Kubernetes pods, through dagster-k8s's `PipesK8sClient`.

`AttemptPodClient` is `PipesK8sClient` (its kube config loading, its API client, its
`build_pod_body` through `ckpt_assets.attempt.k8s_pod.PodPlan.body`) with `run` cut where an
attempt needs more than "wait until the pod is done": the Pipes messages are handled as
they arrive over S3 (checkpoints become Dagster events while it trains), the exit status
is read from the container (the failure policy classifies it, as a local process's), the
pod's output goes to the run's log, and an interrupted step deletes the pod with its grace
(SIGTERM: the trainer commits and exits 143) and waits for it, as a local attempt's
process group is stopped. A pod deleted by anyone else (a preemption, a drain) ends the
same way: a terminated container's status gives 143; a pod gone before its status was seen
is 143 when its trainer reported stopping, else 137 (killed).

A run on several nodes is one indexed Job of a pod per node and the headless Service they
meet through (`ckpt_assets.attempt.k8s_job`), watched the same way: each node's end is read
from its pod, every node's output goes to the run's log (`[trainer node i]`), the attempt
ends once every node has (or one failed and the others had their grace), with the worst
node's status (`k8s_job.nodes_exit`), and an interrupted step deletes every pod with the
grace, then the Job and the Service.

tests/orchestrator/test_k8s_pod.py and test_k8s_job.py check, without a cluster, the specs
it creates, how ended or vanished pods' statuses read, and the API's refusals as bad input
(with fakes of the API); creation, watch, deletion and output against a real cluster are not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import dagster as dg
from dagster_k8s.client import DagsterKubernetesClient
from dagster_k8s.pipes import PipesK8sClient, get_pod_name
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

from ckpt_assets.attempt.command import TrainerCommand
from ckpt_assets.attempt.errors import TrainerStartError
from ckpt_assets.attempt.k8s_job import JobPlan, NodeEnds, completion_index, job_over, job_plan
from ckpt_assets.attempt.k8s_pod import (
    ENDED_UNSEEN,
    KILLED,
    TRAINER_CONTAINER,
    PodPlan,
    k8s_config,
    pod_end,
    pod_plan,
    termination_grace,
)
from ckpt_assets.attempt.output_log import log_output
from ckpt_assets.attempt.process import PROCESS_STARTED, ProcessOutcome, TrackingOpener
from ckpt_assets.attempt.transport import PipesChannels
from ckpt_assets.base.process_group import KILL_WAIT_S
from ckpt_assets.base.registration import Registration
from trainer.base.outcomes import Outcome
from trainer.process.contract import Stopped, parse_message

UNREAD = object()  # the API did not answer one poll
POD_RIGHTS = "create/get/delete on pods (and get on pods/log)"
JOB_RIGHTS = ("create/get/delete on jobs (batch) and services, get/list/delete/deletecollection "
              "on pods (and get on pods/log)")


def run_in_pod(context: dg.AssetExecutionContext, launch: TrainerCommand, reg: Registration, trainer,
               store_uri: str, channels: PipesChannels,
               on_messages: Callable[[list[Any]], None], after_start: Callable[[], None],
               extras: dict[str, Any]) -> ProcessOutcome:
    """Run the attempt `launch` describes as a pod (a Job of one pod per node for several
    nodes) until it ends; the counterpart of `trainer_process.run_under_pipes` (`trainer`
    from `attempt_trainer`)."""
    cfg = k8s_config(trainer, store_uri)
    grace = termination_grace(trainer.grace_period_seconds, (), cfg.grace_margin_seconds)
    plan: PodPlan | JobPlan = pod_plan(launch, reg, trainer, cfg,
                                       get_pod_name(context.run.run_id, context.op.name), grace)
    if reg.config.distributed.nnodes > 1:
        plan = job_plan(plan, reg.config.distributed.nnodes, reg.run, cfg)
    client = AttemptPodClient(context_injector=channels.context_injector,
                              message_reader=channels.message_reader,
                              kubeconfig_file=cfg.kubeconfig_file, kube_context=cfg.kube_context,
                              poll_interval=cfg.poll_interval_seconds)
    return client.run_attempt(context, plan, on_messages, after_start, extras)


@dataclass
class _Watch:
    seen: int = 0
    stopping: bool = False  # the trainer reported a stop (a SIGTERM it obeyed)

    def feed(self, msgs: list[Any], on_messages: Callable[[list[Any]], None]) -> None:
        new = msgs[self.seen:]
        self.seen = len(msgs)
        self.stopping |= any(isinstance(parse_message(m), Stopped) for m in new)
        on_messages(new)

    def exit_code(self, pod) -> int | None:
        """The container's exit status, or what a pod gone (None) before it was seen
        stands for; None while it runs (or was not read this time)."""
        if pod is UNREAD:
            return None
        end = ENDED_UNSEEN if pod is None else pod_end(pod)
        if end is ENDED_UNSEEN:  # gone, or evicted before a status was kept
            return Outcome.PREEMPTED.exit_code if self.stopping else KILLED
        return end


class AttemptPodClient(PipesK8sClient):
    """`PipesK8sClient` for one attempt (see the module's doc)."""

    def run_attempt(self, context, plan: PodPlan | JobPlan,
                    on_messages: Callable[[list[Any]], None],
                    after_start: Callable[[], None], extras: dict[str, Any]) -> ProcessOutcome:
        self._load_k8s_config()
        api = DagsterKubernetesClient.production_client()
        watch = _Watch()
        done = threading.Event()  # the output streams stop when the attempt has ended
        kind = _Nodes if isinstance(plan, JobPlan) else _OnePod
        target = kind(api, plan, watch, context, done)
        with dg.open_pipes_session(context=context, extras=extras,
                                   context_injector=self.context_injector,
                                   message_reader=self.message_reader) as session:
            opener = TrackingOpener(after_start)
            try:
                # Inside: a create whose answer was lost (a 5xx, a timeout, an interrupt)
                # may still have made the pod or Job, which must not outlive the attempt.
                target.create(session.get_bootstrap_env_vars())
                context.log.info(f"{PROCESS_STARTED} ({target.what}, grace "
                                 f"{plan.grace_seconds}s): {' '.join(plan.command)}")
                rc, interrupted = self._wait(context, target, session, watch, on_messages)
            finally:
                done.set()
                target.delete(plan.grace_seconds)
                opener.finish(context.log)
        watch.feed(session.get_custom_messages(), on_messages)  # the session is closed
        return ProcessOutcome(rc, interrupted, [])

    def _wait(self, context, target, session, watch: _Watch,
              on_messages) -> tuple[int, BaseException | None]:
        try:
            while (rc := target.end(context.log)) is None:
                watch.feed(session.get_custom_messages(), on_messages)
                time.sleep(self.poll_interval)
            return rc, None
        except Exception:  # not an interrupt: the pods are deleted on the way out
            raise
        except BaseException as e:  # the step was interrupted: the pods stop as on preemption
            context.log.warning(f"interrupted: deleting {target.what}, grace "
                                f"{target.plan.grace_seconds}s")
            return self._stop(target), e

    def _stop(self, target) -> int:
        grace = target.plan.grace_seconds
        target.delete(grace)
        deadline = time.monotonic() + grace + KILL_WAIT_S
        try:
            while (rc := target.end(None)) is None:
                if time.monotonic() >= deadline:
                    return KILLED
                time.sleep(self.poll_interval)
            return rc
        except BaseException:  # a second interrupt: nothing of the attempt may outlive it
            target.delete(0)
            raise


class _OnePod:
    """The attempt on one node: its pod."""

    def __init__(self, api, plan: PodPlan, watch: _Watch, context, done: threading.Event):
        self.core, self.plan, self.watch = api.core_api, plan, watch
        self.context, self.done = context, done
        self.what = f"pod {plan.namespace}/{plan.name}"

    def create(self, pipes_env) -> None:
        _create(self.core, self.plan, self.plan.body(pipes_env))
        _follow(self.core, self.plan.name, self.plan.namespace, self.context, self.done)

    def end(self, log) -> int | None:
        return self.watch.exit_code(_read(self.core, self.plan, log))

    def delete(self, grace_seconds: int) -> None:
        _delete(self.core, self.plan, grace_seconds)


class _Nodes:
    """The attempt on several nodes: its Job's pods and their Service (`k8s_job`)."""

    def __init__(self, api, plan: JobPlan, watch: _Watch, context, done: threading.Event):
        self.core, self.batch, self.plan, self.watch = api.core_api, api.batch_api, plan, watch
        self.context, self.done = context, done
        self.ends = NodeEnds(plan.nodes, plan.grace_seconds + KILL_WAIT_S)
        self.followed: set[str] = set()
        self.what = (f"job {plan.namespace}/{plan.name}: {plan.nodes} pods meeting at "
                     f"{plan.host}:{plan.port}")

    def create(self, pipes_env) -> None:
        ns, what = self.plan.namespace, f"job {self.plan.namespace}/{self.plan.name}"
        job = _call(lambda: self.batch.create_namespaced_job(ns, self.plan.job(pipes_env)),
                    what, "create", JOB_RIGHTS)
        try:  # owned by the Job: the cluster deletes it with the Job, whoever deletes that
            _call(lambda: self.core.create_namespaced_service(ns, self.plan.service(
                job.metadata.uid)), f"service {ns}/{self.plan.name}", "create", JOB_RIGHTS)
        except BaseException:
            self.delete(0)  # its pods would wait for a name nobody gives them
            raise

    def end(self, log) -> int | None:
        """The attempt's exit status once every node has ended (`NodeEnds.see`)."""
        job = _ask(lambda: self.batch.read_namespaced_job(self.plan.name, self.plan.namespace),
                   f"job {self.plan.namespace}/{self.plan.name}", log, JOB_RIGHTS)
        listed = _ask(lambda: self.core.list_namespaced_pod(
            self.plan.namespace, label_selector=self.plan.selector),
            f"the pods of job {self.plan.namespace}/{self.plan.name}", log, JOB_RIGHTS)
        if job is UNREAD or listed is UNREAD:
            return None
        pods = listed.items if listed is not None else []
        for pod in pods:
            if pod.metadata.name not in self.followed:
                self.followed.add(pod.metadata.name)
                _follow(self.core, pod.metadata.name, self.plan.namespace,
                        _NodeOutput(self.context, completion_index(pod)), self.done)
        if not self.ends.see(job_over(job), pods, time.monotonic()):
            return None
        return self.ends.exit_code(self.watch.stopping)

    def delete(self, grace_seconds: int) -> None:
        """Every pod with `grace_seconds` (a Job's deletion would give them their own
        grace, not the one asked for), then the Job and its Service."""
        ns, name = self.plan.namespace, self.plan.name
        _gone_or_raise(lambda: self.core.delete_collection_namespaced_pod(
            ns, label_selector=self.plan.selector, grace_period_seconds=grace_seconds))
        _gone_or_raise(lambda: self.batch.delete_namespaced_job(
            name, ns, grace_period_seconds=grace_seconds, propagation_policy="Background"))
        _gone_or_raise(lambda: self.core.delete_namespaced_service(name, ns))


class _NodeOutput:
    """A step's context whose `[trainer]` lines say which node they came from."""

    def __init__(self, context, node: int | None):
        tag = f"[trainer node {node if node is not None else '?'}]"
        self.log = SimpleNamespace(
            info=lambda msg: context.log.info(msg.replace("[trainer]", tag, 1)),
            warning=context.log.warning)


def _ask(call: Callable[[], Any], what: str, log, rights: str):
    """`call`'s answer, None once what it reads is gone, or UNREAD when the API did not
    answer this time (the attempt runs on; the next poll asks again)."""
    try:
        return call()
    except ApiException as e:
        if e.status == 404:
            return None
        if e.status is not None and e.status < 500:
            raise _refused(what, "read", e, rights) from None
        failure = f"{e.status} {e.reason}"
    except HTTPError as e:
        failure = str(e)
    if log is not None:
        log.warning(f"{what}: status not read this time ({failure}); asking again")
    return UNREAD


def _read(core, plan: PodPlan, log):
    """The pod, None once it is gone, or UNREAD (`_ask`)."""
    return _ask(lambda: core.read_namespaced_pod(plan.name, plan.namespace),
                f"pod {plan.namespace}/{plan.name}", log, POD_RIGHTS)


def _refused(what: str, verb: str, e, rights: str) -> TrainerStartError:
    return TrainerStartError(f"the Kubernetes API refused to {verb} {what}: {e.status} "
                             f"{e.reason} {(e.body or '')[:500]}; give the run worker's "
                             f"identity {rights} in that namespace, and check "
                             "TrainerResource.k8s")


def _call(call: Callable[[], Any], what: str, verb: str, rights: str):
    try:
        return call()
    except ApiException as e:
        if e.status is not None and e.status < 500:  # forbidden, invalid, no such namespace
            raise _refused(what, verb, e, rights) from None
        raise


def _create(core, plan: PodPlan, body) -> None:
    _call(lambda: core.create_namespaced_pod(plan.namespace, body),
          f"pod {plan.namespace}/{plan.name}", "create", POD_RIGHTS)


def _gone_or_raise(call: Callable[[], Any]) -> None:
    try:
        call()
    except ApiException as e:
        if e.status != 404:
            raise


def _delete(core, plan: PodPlan, grace_seconds: int) -> None:
    _gone_or_raise(lambda: core.delete_namespaced_pod(plan.name, plan.namespace,
                                                      grace_period_seconds=grace_seconds))


def _follow(core, name: str, namespace: str, context, done: threading.Event) -> None:
    threading.Thread(target=_stream_logs, args=(core, name, namespace, context, done),
                     daemon=True, name=f"pod-output-{name}").start()


def _stream_logs(core, name: str, namespace: str, context, done: threading.Event) -> None:
    """The container's output as the run's `[trainer]` lines, once it has started; a
    failure to read it is a warning, never the attempt's end (the messages go over S3)."""
    while not done.is_set():
        try:
            stream = core.read_namespaced_pod_log(name, namespace, container=TRAINER_CONTAINER,
                                                  follow=True, _preload_content=False)
        except ApiException as e:
            if e.status == 400:  # the container is not running yet
                done.wait(2.0)
                continue
            if e.status == 404:  # gone before it ran: its end is read from its status
                return
            context.log.warning(f"pod {name}: its output cannot be read ({e.reason})")
            return
        log_output((raw.decode("utf-8", "replace") for raw in stream), context)
        return
