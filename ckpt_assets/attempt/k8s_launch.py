"""An attempt's process as a Kubernetes pod, through dagster-k8s's `PipesK8sClient`.

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

tests/orchestrator/test_k8s_pod.py checks, without a cluster, the spec it creates (`k8s_pod`), how an
ended or vanished pod's status reads, and the API's refusals as bad input (with fakes of
the API); the pod's creation, watch, deletion and output against a real cluster are not.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import dagster as dg
from dagster_k8s.client import DagsterKubernetesClient
from dagster_k8s.pipes import PipesK8sClient, get_pod_name
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

from ckpt_assets.attempt.command import TrainerCommand
from ckpt_assets.attempt.errors import TrainerStartError
from ckpt_assets.attempt.k8s_pod import PodPlan, k8s_config, pod_plan, termination_grace
from ckpt_assets.attempt.process import PROCESS_STARTED, ProcessOutcome, TrackingOpener, _pump
from ckpt_assets.attempt.process_group import KILL_WAIT_S
from ckpt_assets.attempt.transport import PipesChannels
from ckpt_assets.runs.registration import Registration
from trainer.contract import Stopped, parse_message
from trainer.outcomes import Outcome

KILLED = 128 + signal.SIGKILL  # a container's exit status after SIGKILL
# A container that cannot start for a reason no retry fixes: the config is wrong.
UNREAD = object()  # the API did not answer one poll
NEVER_STARTS = frozenset({"CreateContainerConfigError", "InvalidImageName", "ErrImageNeverPull"})


def run_in_pod(context: dg.AssetExecutionContext, launch: TrainerCommand, reg: Registration, trainer,
               store_uri: str, channels: PipesChannels,
               on_messages: Callable[[list[Any]], None], after_start: Callable[[], None],
               extras: dict[str, Any]) -> ProcessOutcome:
    """Run the attempt `launch` describes as a pod until it ends; the counterpart of
    `trainer_process.run_under_pipes` (`trainer` from `attempt_trainer`)."""
    cfg = k8s_config(trainer, store_uri)
    grace = termination_grace(trainer.grace_period_seconds, (), cfg.grace_margin_seconds)
    plan = pod_plan(launch, reg, trainer, cfg, get_pod_name(context.run.run_id, context.op.name),
                    grace)
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
        if pod is None:
            return Outcome.PREEMPTED.exit_code if self.stopping else KILLED
        for status in pod.status.container_statuses or []:
            state = status.state
            if state.terminated is not None:
                return state.terminated.exit_code
            if state.waiting is not None and state.waiting.reason in NEVER_STARTS:
                raise TrainerStartError(f"pod {pod.metadata.name} cannot start its container: "
                                  f"{state.waiting.reason}: {state.waiting.message}; fix "
                                  "TrainerResource.k8s (image, Secret names)")
        if pod.status.phase in ("Failed", "Succeeded"):  # evicted before a status was kept
            return 0 if pod.status.phase == "Succeeded" else self.exit_code(None)
        return None


class AttemptPodClient(PipesK8sClient):
    """`PipesK8sClient` for one attempt (see the module's doc)."""

    def run_attempt(self, context, plan: PodPlan, on_messages: Callable[[list[Any]], None],
                    after_start: Callable[[], None], extras: dict[str, Any]) -> ProcessOutcome:
        self._load_k8s_config()
        core = DagsterKubernetesClient.production_client().core_api
        watch = _Watch()
        with dg.open_pipes_session(context=context, extras=extras,
                                   context_injector=self.context_injector,
                                   message_reader=self.message_reader) as session:
            _create(core, plan, plan.body(session.get_bootstrap_env_vars()))
            context.log.info(f"{PROCESS_STARTED} (pod {plan.namespace}/{plan.name}, grace "
                             f"{plan.grace_seconds}s): {' '.join(plan.command)}")
            opener = TrackingOpener(after_start)
            done = threading.Event()
            threading.Thread(target=_stream_logs, args=(core, plan, context, done),
                             daemon=True, name="pod-output").start()
            try:
                rc, interrupted = self._wait(context, core, plan, session, watch, on_messages)
            finally:
                done.set()
                _delete(core, plan, plan.grace_seconds)
                opener.finish(context.log)
        watch.feed(session.get_custom_messages(), on_messages)  # the session is closed
        return ProcessOutcome(rc, interrupted, [])

    def _wait(self, context, core, plan: PodPlan, session, watch: _Watch,
              on_messages) -> tuple[int, BaseException | None]:
        try:
            while (rc := watch.exit_code(_read(core, plan, context.log))) is None:
                watch.feed(session.get_custom_messages(), on_messages)
                time.sleep(self.poll_interval)
            return rc, None
        except Exception:  # not an interrupt: the pod is deleted on the way out
            raise
        except BaseException as e:  # the step was interrupted: the pod stops as on preemption
            context.log.warning(f"interrupted: deleting pod {plan.name}, grace "
                                f"{plan.grace_seconds}s")
            return self._stop(core, plan, watch), e

    def _stop(self, core, plan: PodPlan, watch: _Watch) -> int:
        _delete(core, plan, plan.grace_seconds)
        deadline = time.monotonic() + plan.grace_seconds + KILL_WAIT_S
        try:
            while (rc := watch.exit_code(_read(core, plan, None))) is None:
                if time.monotonic() >= deadline:
                    return KILLED
                time.sleep(self.poll_interval)
            return rc
        except BaseException:  # a second interrupt: nothing of the attempt may outlive it
            _delete(core, plan, 0)
            raise


def _read(core, plan: PodPlan, log):
    """The pod, None once it is gone, or UNREAD when the API did not answer this time (the
    pod runs on; the next poll asks again)."""
    try:
        return core.read_namespaced_pod(plan.name, plan.namespace)
    except ApiException as e:
        if e.status == 404:
            return None
        if e.status is not None and e.status < 500:
            raise _refused(plan, "read", e) from None
        failure = f"{e.status} {e.reason}"
    except HTTPError as e:
        failure = str(e)
    if log is not None:
        log.warning(f"pod {plan.name}: status not read this time ({failure}); asking again")
    return UNREAD


def _refused(plan: PodPlan, verb: str, e) -> TrainerStartError:
    return TrainerStartError(f"the Kubernetes API refused to {verb} pod {plan.namespace}/{plan.name}: "
                       f"{e.status} {e.reason} {(e.body or '')[:500]}; give the run worker's "
                       "identity create/get/delete on pods (and get on pods/log) in that "
                       "namespace, and check TrainerResource.k8s")


def _create(core, plan: PodPlan, body) -> None:
    try:
        core.create_namespaced_pod(plan.namespace, body)
    except ApiException as e:
        if e.status is not None and e.status < 500:  # forbidden, invalid, no such namespace
            raise _refused(plan, "create", e) from None
        raise


def _delete(core, plan: PodPlan, grace_seconds: int) -> None:
    try:
        core.delete_namespaced_pod(plan.name, plan.namespace, grace_period_seconds=grace_seconds)
    except ApiException as e:
        if e.status != 404:
            raise


def _stream_logs(core, plan: PodPlan, context, done: threading.Event) -> None:
    """The container's output as the run's `[trainer]` lines, once it has started; a
    failure to read it is a warning, never the attempt's end (the messages go over S3)."""
    while not done.is_set():
        try:
            stream = core.read_namespaced_pod_log(plan.name, plan.namespace, follow=True,
                                                  _preload_content=False)
        except ApiException as e:
            if e.status == 400:  # the container is not running yet
                done.wait(2.0)
                continue
            if e.status == 404:  # gone before it ran: its end is read from its status
                return
            context.log.warning(f"pod {plan.name}: its output cannot be read ({e.reason})")
            return
        _pump((raw.decode("utf-8", "replace") for raw in stream), context)
        return
