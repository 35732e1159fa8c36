"""One attempt of a training run, as the orchestrator sees it: the Pipes messages of the
training process turned into Dagster events, and how the attempt ended.

* each committed checkpoint -> an ASSET_OBSERVATION `checkpoint` of model_checkpoint for the
  partition, with the lineage metadata (`ckpt_assets.base.metadata.CHECKPOINT_METADATA_KEYS`);
  only a finished run materializes the partition (`ckpt_assets.base.events` says why);
* the end of the attempt -> an ASSET_OBSERVATION `attempt_ended` (also on success and on
  cancellation) with the fields of `AttemptEnd`;
* a non-zero exit -> `dagster.Failure` carrying a `AttemptEnd` (and the user's
  traceback, as one Markdown code block), which the resume sensor reads back from the
  STEP_FAILURE event; the `failed` report itself -> ONE error log entry with the traceback;
* a resume's start -> a link both ways between it and the run it resumes (`link_resume`);
* before an attempt starts, checkpoints that earlier attempts committed but never reported
  (their orchestrator died first) -> late checkpoint observations (`record_unseen_checkpoints`);
* once the MLflow run opens, every checkpoint those observations record (every attempt's,
  those retention removed from the store too) -> MLflow's histories (`catch_up_tracking`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import dagster as dg

from ckpt_assets.attempt.process import ProcessOutcome
from ckpt_assets.base.dagster_private import report_engine_event
from ckpt_assets.base.end import AttemptEnd
from ckpt_assets.base.events import (
    ATTEMPT_ENDED,
    CHECKPOINT,
    MODEL_CHECKPOINT_KEY,
    partition_events,
    recorded_checkpoint_names,
)
from ckpt_assets.base.metadata import checkpoint_metadata, to_metadata
from ckpt_assets.base.tags import (
    PARTITION_TAG,
    TAG_ATTEMPT,
    TAG_DECISION,
    TAG_DECISION_REASON,
    TAG_PARENT_RUN_ID,
    TAG_RESUMED_BY,
)
from ckpt_assets.lifecycle.decision_record import mirror_tags, read_decision
from ckpt_assets.lifecycle.transition import Writes, put_back
from ckpt_assets.mlflow.tracking import MlflowTracker
from trainer.base.errors import CheckpointError, StorageError, TrainerError
from trainer.base.outcomes import Outcome, signal_name
from trainer.checkpoints.records import CheckpointRecord
from trainer.checkpoints.repo import CheckpointRepo
from trainer.process.contract import (
    Eval,
    Failed,
    Finished,
    Message,
    Progress,
    Started,
    Stopped,
    parse_message,
)
from trainer.storage import ObjectStore

TRACEBACK_MAX_CHARS = 20_000  # the end of a traceback is where the error is


def newest_progress_only(msgs: list[Message]) -> list[Message]:
    """`msgs` without the progress reports a later one in the same batch supersedes. Each one
    handled is an event-log write (tens of ms on SQLite): a trainer that beats faster than
    that would otherwise put every report after it, its last checkpoint and its end, behind."""
    last = max((i for i, m in enumerate(msgs) if isinstance(m, Progress)), default=-1)
    return [m for i, m in enumerate(msgs) if not isinstance(m, Progress) or i == last]


@dataclass
class AttemptReport:
    """What the training process reported during one attempt (`trainer.process.contract`)."""

    run: str
    attempt: int
    started: Started | None = None
    failed: Failed | None = None
    stopped: Stopped | None = None
    finished: Finished | None = None
    checkpoints: list[CheckpointRecord] = field(default_factory=list)
    step: int = 0  # the newest step it reported

    def near_its_end(self) -> bool:
        """Whether the trainer reported a step in the last tenth of its `max_steps` (or
        spoke without saying how many it trains): what the run's last steps need may load
        now (`ckpt_assets.attempt.prefetch`). Sooner would load it for every attempt that is
        interrupted, which is most of a long job's."""
        if self.started is None:
            return False
        end = self.started.max_steps
        return end is None or self.step >= end - end // 10

    def handle(self, context, tracker: MlflowTracker, msgs: list[Any]) -> None:
        parsed = [m for m in map(parse_message, msgs) if m is not None]
        for msg in newest_progress_only(parsed):
            self._one(context, tracker, msg)

    def _one(self, context, tracker: MlflowTracker, msg: Message) -> None:
        self.step = max(self.step, getattr(msg, "step", None) or 0,
                        getattr(msg, "resumed_from_step", None) or 0)
        match msg:
            case CheckpointRecord():
                self._checkpoint(context, tracker, msg)
            case Eval():
                tracker.on_eval(msg)
            case Started():
                self.started = msg
                tracker.on_started(msg)
                context.log.info(f"attempt {msg.attempt} started" + (
                    f", resumed from step {msg.resumed_from_step} ({msg.resumed_from})"
                    if msg.resumed_from_step is not None else " from scratch"))
                for s in msg.skipped:
                    context.log.warning(f"CHECKPOINT FALLBACK: {s.checkpoint} skipped: {s.reason}")
            case Failed():
                self.failed = msg
                # One entry for the whole traceback: the UI shows it as one event, not one
                # per line.
                tb = msg.traceback
                context.log.error(
                    f"training process failed: {msg.failure_class}: {msg.error_type}: "
                    f"{msg.message}" + (f"\n{tb[-TRACEBACK_MAX_CHARS:].rstrip()}" if tb else ""))
            case Stopped():
                self.stopped = msg
            case Finished():
                self.finished = msg
            case Progress():
                context.log.debug(f"progress: step {msg.step} loss {msg.loss}")

    def _checkpoint(self, context, tracker: MlflowTracker, rec: CheckpointRecord) -> None:
        lineage_run = rec.lineage.run if rec.lineage else self.run
        if lineage_run != self.run:
            # The contract says a trainer writes only its own run; a report of another's is
            # a breach, never recorded as this run's history.
            context.log.error(f"ignored a checkpoint report for run {lineage_run!r} from the "
                              f"trainer of run {self.run!r}: {rec.uri}")
            return
        self.checkpoints.append(rec)
        context.log_event(checkpoint_event(
            rec, self.run, f"checkpoint step {rec.step} committed (loss {rec.loss})"))
        tracker.on_checkpoint(rec)

    def outcome(self, repo: CheckpointRepo, proc: ProcessOutcome, context) -> AttemptEnd:
        """How the attempt ended (exit 0 included), with the run's last committed step."""
        try:
            ptr = repo.read_pointer()
        except (CheckpointError, StorageError):
            ptr = None
        last = None
        if ptr and ptr.checkpoint:
            try:
                last = CheckpointRecord.from_manifest(repo.read_manifest(ptr.checkpoint),
                                                      repo.uri(ptr.checkpoint))
            except TrainerError:  # unreadable: the pointer's step is all there is to say
                last = None
        last_step = ptr.step if ptr and ptr.checkpoint else None
        last_uri = repo.uri(ptr.checkpoint) if ptr and ptr.checkpoint else None
        if last_step is None and self.checkpoints:
            last = self.checkpoints[-1]
            last_step, last_uri = last.step, last.uri
        rc = proc.returncode
        outcome = exit_outcome(rc, self.failed.failure_class if self.failed else None,
                               final=self.is_final(last), committed=last_uri is not None,
                               left_running=len(proc.left_running))
        started = self.started
        return AttemptEnd(
            outcome, self.run, exit_code=int(rc), attempt=self.attempt,
            last_committed_step=last_step, checkpoint_uri=last_uri,
            signal=signal_name(rc) if rc else None,
            message=self.failed.message if self.failed else _left_words(proc.left_running),
            error_type=self.failed.error_type if self.failed else None,
            dagster_run_id=context.run.run_id,
            root_run_id=started.lineage.get("root_run_id") if started else None,
            resumed_from_step=started.resumed_from_step if started else None,
            checkpoints_this_attempt=len(self.checkpoints))

    def is_final(self, rec: CheckpointRecord | None) -> bool:
        """Whether `rec` (the run's newest checkpoint) ends the run: marked final, or this
        attempt's own checkpoint of the step its session reported finishing at (a script
        without max_steps whose last step a trigger had committed already)."""
        if rec is None:
            return False
        if rec.final:
            return True
        return (self.finished is not None and self.started is not None
                and rec.step == self.finished.step and rec.attempt == self.started.attempt)


def exit_outcome(rc: int, reported: str | None, *, final: bool, committed: bool,
                 left_running: int) -> Outcome:
    """The outcome of an attempt whose main process exited `rc`: a run is finished only by
    a final checkpoint, so an exit 0 without one is a failure of its own (`unfinished`:
    the command forked the training off and exited, or left by os._exit, before its session
    committed the final checkpoint; `no_checkpoint`: it never committed and left nothing
    running)."""
    outcome = Outcome.of_exit(rc, reported)
    if outcome is not Outcome.SUCCESS or final:
        return outcome
    return Outcome.UNFINISHED if committed or left_running else Outcome.NO_CHECKPOINT


def _left_words(pids: list[int]) -> str | None:
    if not pids:
        return None
    return (f"{len(pids)} process(es) of the attempt were still running after its main "
            f"process exited (pids {', '.join(map(str, sorted(pids)))}); they were stopped")


def record_end(context, ended: AttemptEnd, interrupted: bool,
               extra: dict[str, Any]) -> None:
    context.log_event(dg.AssetObservation(
        asset_key=MODEL_CHECKPOINT_KEY, partition=ended.training_run,
        metadata=to_metadata({"event": ATTEMPT_ENDED, **ended.to_dict(),
                              "interrupted": interrupted, **extra}),
        description=f"attempt {ended.attempt} ended: exit {ended.exit_code} "
                    f"({ended.outcome.value})"))


def failure_description(ended: AttemptEnd) -> str:
    if ended.outcome is Outcome.STOPPED_BY_USER:
        return ended.message or "stopped for good on request"
    if ended.outcome is Outcome.NO_CHECKPOINT:
        return (f"the training process of {ended.training_run} exited 0 without committing a "
                "checkpoint; a command must checkpoint through trainer.CheckpointSession "
                "(see the README's own-loop example)")
    if ended.outcome is Outcome.UNFINISHED:
        left = f"; {ended.message}" if ended.message else ""
        return (f"the training process of {ended.training_run} exited 0 in attempt "
                f"{ended.attempt} before the run's final checkpoint (last committed step "
                f"{ended.last_committed_step}){left}. Not finished, so final_model was not "
                f"made: {Outcome.UNFINISHED.kind.advice}")
    where = f" ({ended.checkpoint_uri})" if ended.checkpoint_uri else ""
    msg = f": {ended.message}" if ended.message else ""
    if ended.kind.resumable:
        # Read first on the run page: what happened and what comes next, not a crash.
        sig = f" ({ended.signal})" if ended.signal else ""
        return (f"{ended.outcome.value}, not a bug: the training process exited "
                f"{ended.exit_code}{sig} in attempt {ended.attempt} of training run "
                f"{ended.training_run}: {ended.outcome.seen_as}; last committed step "
                f"{ended.last_committed_step}{where}. To be resumed {ended.kind.resume} "
                f"by the resume sensors{msg}")
    sig = f", {ended.signal}" if ended.signal else ""
    return (f"training process exited {ended.exit_code} ({ended.outcome.value}{sig}) in "
            f"attempt {ended.attempt} of training run {ended.training_run}; last committed "
            f"step {ended.last_committed_step}{where}{msg}")


def attempt_failure(ended: AttemptEnd, report: AttemptReport) -> dg.Failure:
    """The step's Failure: the AttemptEnd record, plus the user's traceback (when the
    trainer reported one) as one Markdown code block the UI shows whole."""
    md = to_metadata(ended.to_dict())
    tb = report.failed.traceback if report.failed else None
    if tb:
        md["traceback"] = dg.MetadataValue.md(f"```\n{tb[-TRACEBACK_MAX_CHARS:]}\n```")
    md["resumed"] = str(ended.kind.resume)  # in the failure's table, next to its class
    # Resuming is the sensors' decision, made once: never a Dagster step retry.
    return dg.Failure(description=failure_description(ended), metadata=md, allow_retries=False)


def link_resume(w: Writes, run: dg.DagsterRun, log,
                store: ObjectStore | None = None) -> str | None:
    """A resume run, once it runs, links itself and the failed run it resumes both ways.

    The sensor decides on the failed run and writes its decision there, but the resume's
    run id exists only after the daemon launched it: so the resume says it, here, in its
    own log (`/runs/<parent>`) and on the failed run (an engine event and the tag
    `ckpt/resumed_by`). The failed run's record has long settled by now, so this is also
    where its decision's tags are put back if Dagster's rewrite of the ended run dropped
    them (`lifecycle.decision_record`). Returns the parent's run id; best-effort (never
    fails the step)."""
    parent_id, instance = run.tags.get(TAG_PARENT_RUN_ID), w.instance
    if not parent_id:
        return None
    try:
        parent = instance.get_run_by_id(parent_id)
        if parent is not None and store is not None and TAG_DECISION not in parent.tags:
            rec = read_decision(store, run.tags.get(PARTITION_TAG, ""), parent_id)
            if rec is not None:
                put_back(instance, parent_id, mirror_tags(rec))
                parent = instance.get_run_by_id(parent_id)
        reason = parent.tags.get(TAG_DECISION_REASON, "") if parent is not None else ""
        attempt = run.tags.get(TAG_ATTEMPT, "?")
        # Engine events, not log lines: their dagster_run metadata is a link in the UI.
        report_engine_event(
            instance, run, f"resuming failed run {parent_id} as attempt {attempt}" + (
                f": {reason}" if reason else ""),
            {"resumes": dg.MetadataValue.dagster_run(parent_id)})
        if parent is not None and parent.tags.get(TAG_RESUMED_BY) != run.run_id:
            w.tag(parent_id, {TAG_RESUMED_BY: run.run_id})
            report_engine_event(instance, parent, f"resumed by run {run.run_id}, attempt {attempt}",
                                {"resumed_by": dg.MetadataValue.dagster_run(run.run_id)})
    except Exception as e:  # a missing or unwritable parent record must not stop training
        log.warning(f"could not link resume {run.run_id} to run {parent_id}: {e}")
    return parent_id


def checkpoint_event(rec: CheckpointRecord, run: str, description: str,
                     extra: dict[str, Any] | None = None) -> dg.AssetObservation:
    """A committed checkpoint, as the partition's `checkpoint` observation."""
    return dg.AssetObservation(
        asset_key=MODEL_CHECKPOINT_KEY, partition=run, description=description,
        metadata={"event": CHECKPOINT, **checkpoint_metadata(rec), **to_metadata(extra or {})})


def record_unseen_checkpoints(context, repo: CheckpointRepo, run: str,
                              known: set[str] | frozenset[str] = frozenset()
                              ) -> list[CheckpointRecord]:
    """Record the run's committed checkpoints that Dagster never saw, oldest first
    (`known`: names this step already recorded, whose events may not be stored yet).

    A trainer reports each checkpoint over Pipes after committing it; when its run worker
    is killed, the trainer still commits on the way out (SIGTERM through PR_SET_PDEATHSIG),
    but nobody reads that report. Without a record the next checkpoint's parent link would
    point at nothing in Dagster. The pointer's timeline (the line this run continues) is
    compared with the partition's checkpoint observations; each missing checkpoint is logged with
    the usual lineage metadata, `recorded_late: true` and who committed it. Best-effort: an
    unreadable store is the trainer's to report, so nothing here fails the attempt.
    """
    try:
        ptr = repo.read_pointer()
    except TrainerError:
        return []
    names = ptr.timeline[::-1] if ptr else []
    if not names:
        return []
    seen = recorded_checkpoint_names(context.instance, run) | set(known)
    late = []
    for name in names:
        if name in seen:
            continue
        try:
            m = repo.read_manifest(name)
        except TrainerError:  # removed by retention since, or unreadable: nothing to record
            continue
        rec = CheckpointRecord.from_manifest(m, repo.uri(m.name))
        lin = rec.lineage
        if lin and lin.dagster_run_id == context.run.run_id:
            how = "by this attempt's trainer, which exited before reporting it"
        elif lin and lin.dagster_run_id:
            how = f"by attempt {rec.attempt} (Dagster run {lin.dagster_run_id}) after its " \
                  "orchestrator died"
        else:
            how = f"by attempt {rec.attempt} outside Dagster"
        context.log_event(checkpoint_event(
            rec, run, f"checkpoint step {rec.step} committed {how}; recorded late by "
                      f"Dagster run {context.run.run_id}",
            {"recorded_late": True, "recorded_by_run_id": context.run.run_id}))
        late.append(rec)
    if late:
        context.log.warning(
            f"recorded {len(late)} checkpoint(s) that earlier attempts committed but never "
            f"reported: {', '.join(r.name for r in late)}")
    return late


def recorded_checkpoints(instance: dg.DagsterInstance, run: str) -> list[CheckpointRecord]:
    """Every checkpoint the partition's `checkpoint` observations record, of every attempt:
    the run's whole history (retention deletes checkpoints from the store, never their
    observations)."""
    out = []
    for md, _ in partition_events(instance, run, CHECKPOINT):
        try:
            out.append(CheckpointRecord.from_dict(md))
        except (TypeError, ValueError):  # a record without its step or name: nothing to log
            continue
    return out


def catch_up_tracking(tracker: MlflowTracker, instance: dg.DagsterInstance,
                      repo: CheckpointRepo | None = None) -> int:
    """MLflow's histories caught up with every committed checkpoint the run's own records
    know: its checkpoint observations in Dagster and, with `repo`, the store's checkpoints
    that no attempt reported. Each step is logged once however often it is recorded (the
    tracker's rule), so calling this on every opening is safe. Returns how many losses were
    logged; best-effort, like all of MLflow."""
    if tracker.run_id is None:
        return 0
    try:
        records = recorded_checkpoints(instance, tracker.training_run)
    except Exception as e:  # MLflow is a view: an unreadable event log costs only the view
        tracker.mlflow_run.warn("reading the run's checkpoint records", e)
        records = []
    n = tracker.catch_up(records)
    return n + (tracker.backfill(repo) if repo is not None else 0)
