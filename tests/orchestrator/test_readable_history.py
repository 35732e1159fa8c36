"""What a person reads in Dagster: links, the metrics table and loss plot across attempts,
a traceback as one event, and the resume decision in the failed run's own log. Fast: no
training, real Dagster instances, and the training process's output as the text it prints
(tests/orchestrator/test_traceback_event.py reads it from the real trainer's stream)."""

from __future__ import annotations

import base64
import io
import traceback

import dagster as dg
import pytest
from dagster._core.test_utils import create_run_for_test

from ckpt_assets.attempt.messages import (
    AttemptReport,
    attempt_failure,
    checkpoint_event,
    link_resume,
)
from ckpt_assets.attempt.output_log import log_output
from ckpt_assets.base.end import AttemptEnd
from ckpt_assets.base.metadata import checkpoint_metadata
from ckpt_assets.base.tags import PARTITION_TAG, TAG_ATTEMPT, TAG_PARENT_RUN_ID, TAG_RESUMED_BY
from ckpt_assets.lifecycle.decision import record as record_decision
from ckpt_assets.lifecycle.policy import Budget, Decision
from ckpt_assets.lifecycle.transition import Writes
from ckpt_assets.records.history import (
    BARS,
    NO_LOSS,
    RESUME_MARK,
    SPARK_WIDTH,
    history_frame,
    history_metadata,
)
from tests import dagster_runs
from trainer.base.outcomes import Kind, Outcome
from trainer.checkpoints.records import CheckpointRecord, Lineage
from trainer.process.contract import Failed

KEY = "hist-run"


class Log:
    def __init__(self):
        self.entries: list[tuple[str, str]] = []

    def __getattr__(self, level):
        if level not in ("debug", "info", "warning", "error"):
            raise AttributeError(level)
        return lambda msg: self.entries.append((level, msg))


class Context:
    def __init__(self, run_id: str = "run-x"):
        self.log = Log()
        self.run = dg.DagsterRun(job_name="train_job", run_id=run_id)


class NoTracker:
    def __getattr__(self, name):
        return lambda *a, **k: None


@pytest.fixture
def instance():
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def record(step: int, attempt: int, loss: float, resumed_from: int | None = None,
           uri_root: str = "file:///store/exp/hist-run/checkpoints") -> CheckpointRecord:
    name = f"step-{step:09d}-a{attempt}"
    return CheckpointRecord(
        name=name, uri=f"{uri_root}/{name}", step=step, attempt=attempt, sha256="0" * 64,
        size=10, loss=loss, eval={"loss": loss + 0.1, "accuracy": 0.5},
        lineage=Lineage("exp", KEY, attempt, dagster_run_id=f"run-{attempt}",
                        resumed_from_step=resumed_from))


def record_checkpoint(instance, rec: CheckpointRecord) -> None:
    instance.report_runless_asset_event(checkpoint_event(rec, KEY, f"step {rec.step}"))


# -- links ------------------------------------------------------------------------------------

def test_a_checkpoints_uri_stays_a_string_and_is_also_a_path_link_for_a_local_store():
    md = checkpoint_metadata(record(10, 1, 1.0))
    assert md["uri"] == "file:///store/exp/hist-run/checkpoints/step-000000010-a1"
    assert md["uri_link"] == dg.MetadataValue.path(
        "/store/exp/hist-run/checkpoints/step-000000010-a1")


def test_typed_values_such_as_links_pass_through_plain_values_to_metadata():
    from ckpt_assets.base.metadata import links, to_metadata

    md = to_metadata({"n": None, **links({"checkpoint_uri": "/tmp/x", "mlflow_run": None})})
    assert md == {"n": dg.MetadataValue.null(),
                  "checkpoint_uri_link": dg.MetadataValue.path("/tmp/x")}


def test_a_checkpoint_on_s3_is_a_url_link():
    md = checkpoint_metadata(record(10, 1, 1.0, uri_root="s3://bucket/p/exp/hist-run/checkpoints"))
    assert md["uri_link"] == dg.MetadataValue.url(
        "s3://bucket/p/exp/hist-run/checkpoints/step-000000010-a1")


# -- the metrics table and the plot -----------------------------------------------------------

def test_the_metrics_table_spans_attempts_and_marks_the_first_checkpoint_after_each_resume(
        instance):
    for rec in (record(10, 1, 1.0), record(20, 1, 0.8), record(30, 2, 0.6, resumed_from=20)):
        record_checkpoint(instance, rec)
    # This attempt's own checkpoints are not stored before its output: passed along.
    df = history_frame(instance, KEY, [record(30, 2, 0.6, 20), record(40, 2, 0.5, 20)])
    assert list(df["step"]) == [10, 20, 30, 40]
    assert list(df["attempt"]) == [1, 1, 2, 2]
    assert list(df["resumed"]) == [False, False, True, False]
    assert list(df.columns) == ["step", "attempt", "loss", "eval_accuracy", "eval_loss",
                                "checkpoint", "resumed", "resumed_from_step", "recorded_late"]
    assert df["eval_loss"].iloc[-1] == pytest.approx(0.6)


def test_the_metrics_table_keeps_only_the_newest_rows_up_to_its_bound(instance):
    for step in range(10, 90, 10):
        record_checkpoint(instance, record(step, 1, 1.0 / step))
    df = history_frame(instance, KEY, limit=5)
    assert list(df["step"]) == [40, 50, 60, 70, 80]


def test_the_history_is_a_dagster_table_a_text_sparkline_and_a_png_plot_in_markdown(instance):
    record_checkpoint(instance, record(10, 1, 1.0))
    record_checkpoint(instance, record(20, 2, float("nan"), resumed_from=10))
    md = history_metadata(instance, KEY)
    table = md["metrics_history"]
    assert isinstance(table, dg.TableMetadataValue)
    assert [c.name for c in table.schema.columns][:3] == ["step", "attempt", "loss"]
    rows = [r.data for r in table.records]
    assert rows[1]["loss"] is None and rows[1]["resumed"] is True  # NaN: no number to show
    text = md["loss_plot_image"].value
    assert text.startswith("![loss versus step](data:image/png;base64,")
    png = base64.b64decode(text.split("base64,", 1)[1].split(")", 1)[0])
    assert png.startswith(b"\x89PNG") and len(png) < 200_000
    assert "attempt 2 from step 10" in text


def test_the_loss_plot_is_text_one_bar_per_checkpoint_with_each_resume_marked(instance):
    # Text, because Dagster 1.13 shows a text value in the metadata table itself and a
    # Markdown one (the image) only behind a toggle.
    for step, attempt, loss, resumed_from in [(10, 1, 4.0, None), (20, 1, 3.0, None),
                                              (30, 2, float("nan"), 20), (40, 2, 1.0, None),
                                              (50, 2, 0.5, None)]:
        record_checkpoint(instance, record(step, attempt, loss, resumed_from=resumed_from))
    plot = history_metadata(instance, KEY)["loss_plot"]
    assert isinstance(plot, dg.TextMetadataValue)
    assert plot.value.startswith(f"4 {BARS[-1]}{BARS[5]}{RESUME_MARK}{NO_LOSS}{BARS[1]}"
                                 f"{BARS[0]} 0.5  (loss at steps 10–50, 5 of 5 checkpoints")
    assert plot.value.endswith(f"{RESUME_MARK} resumed: attempt 2 from step 20)")


def test_the_loss_plot_draws_the_newest_checkpoints_and_says_how_many_it_left_out(instance):
    for step in range(1, SPARK_WIDTH + 6):
        record_checkpoint(instance, record(step * 10, 1, 1.0 / step))
    text = history_metadata(instance, KEY)["loss_plot"].value
    assert f"loss at steps 60–{(SPARK_WIDTH + 5) * 10}, {SPARK_WIDTH} of {SPARK_WIDTH + 5}" \
        in text
    bars = text.split(" ")[1]
    assert len(bars) == SPARK_WIDTH and bars[0] == BARS[-1] and bars[-1] == BARS[0]


def test_a_history_that_cannot_be_built_is_a_warning_not_a_failed_run():
    log = Log()

    class Broken:
        def fetch_observations(self, *a, **k):
            raise RuntimeError("event log unavailable")

    assert history_metadata(Broken(), KEY, log=log) == {}
    assert log.entries and log.entries[0][0] == "warning"


# -- a traceback is one event -----------------------------------------------------------------

def _chained_error() -> None:
    try:
        raise KeyError("inner")
    except KeyError as e:
        raise ValueError("outer") from e


def _printed_by_a_failing_script() -> str:
    """What a script prints when it reports a chained error itself, goes on, and then dies
    of another: the interpreter prints the last traceback on its way out."""
    out = io.StringIO()
    print("before", file=out)
    try:
        _chained_error()
    except ValueError:
        traceback.print_exc(file=out)
    print("after", file=out)
    try:
        raise RuntimeError("boom")
    except RuntimeError as e:
        out.write("".join(traceback.format_exception(e)))
    return out.getvalue()


def test_a_traceback_printed_by_the_training_process_is_one_log_entry_not_one_per_line():
    ctx = Context()
    log_output(iter(io.StringIO(_printed_by_a_failing_script())), ctx)
    msgs = [m for _, m in ctx.log.entries]
    assert msgs[0] == "[trainer] before" and msgs[2] == "[trainer] after"
    assert len(msgs) == 4, msgs
    chained = msgs[1]
    assert chained.startswith("[trainer] Traceback (most recent call last):")
    assert "KeyError: 'inner'" in chained and "direct cause" in chained
    assert chained.rstrip().endswith("ValueError: outer")
    assert msgs[3].rstrip().endswith("RuntimeError: boom") and "Traceback" in msgs[3]


def test_a_failed_report_with_a_traceback_is_one_error_entry(instance):
    ctx = Context()
    report = AttemptReport(KEY, 1)
    tb = 'Traceback (most recent call last):\n  File "t.py", line 1\nValueError: boom\n'
    report.handle(ctx, NoTracker(), [{"type": "failed", "exit_code": 1,
                                      "failure_class": "user_code_error",
                                      "error_type": "ValueError", "message": "boom",
                                      "traceback": tb}])
    (entry,) = ctx.log.entries
    assert entry[0] == "error" and tb.strip() in entry[1] and "ValueError: boom" in entry[1]


def test_the_step_failure_carries_the_record_and_the_traceback_as_one_code_block():
    report = AttemptReport(KEY, 1, failed=Failed(1, "user_code_error", "ValueError", "boom",
                                                 "Traceback ...\nValueError: boom"))
    ended = AttemptEnd(Outcome.USER_CODE_ERROR, KEY, 1, attempt=1, message="boom")
    failure = attempt_failure(ended, report)
    md = failure.metadata
    assert md["traceback"] == dg.MetadataValue.md("```\nTraceback ...\nValueError: boom\n```")
    plain = {k: v.value for k, v in md.items()}
    assert AttemptEnd.from_metadata(plain) == ended  # what the resume sensor reads back
    assert "exited 1 (user_code_error)" in failure.description


# -- the resume decision, in the failed run's own log -----------------------------------------

def _engine_events(instance, run) -> list:
    return [r.dagster_event for r in instance.all_logs(
        run.run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)]


def test_a_resume_decision_is_one_engine_event_in_words_on_the_failed_run(
        instance, checkpoint_store):
    run = dagster_runs.lost_worker_run(instance, KEY)
    failure = AttemptEnd(Outcome.WORKER_LOST, KEY, attempt=1, last_committed_step=20,
                         dagster_run_id=run.run_id)
    record_decision(instance, run, failure, Decision(
        True, Kind.KILLED, "resumed: run worker lost", budget=Budget(transient=1)),
        checkpoint_store)
    (event,) = _engine_events(instance, run)
    assert event.message.startswith("Resuming now (killed): resumed: run worker lost")
    assert f"resume-{run.run_id}" in event.message
    md = {k: v.value for k, v in event.engine_event_data.metadata.items()}
    assert md["decision"] == "resume" and md["resume_run_key"] == f"resume-{run.run_id}"
    assert md["last_committed_step"] == 20


def test_a_decision_not_to_resume_says_why_in_the_failed_runs_log(instance, checkpoint_store):
    run = dagster_runs.lost_worker_run(instance, KEY)
    failure = AttemptEnd(Outcome.DIVERGED, KEY, 4, attempt=1, last_committed_step=20,
                         dagster_run_id=run.run_id)
    record_decision(instance, run, failure,
                    Decision(False, Kind.DIVERGED, "not resumed: the loss diverged"),
                    checkpoint_store)
    (event,) = _engine_events(instance, run)
    assert event.message == "Not resumed (diverged): the loss diverged"


def test_a_resume_run_links_itself_and_the_failed_run_both_ways_once(instance):
    failed = dagster_runs.lost_worker_run(instance, KEY)
    resume = create_run_for_test(instance, job_name="train_job", tags={
        PARTITION_TAG: KEY, TAG_PARENT_RUN_ID: failed.run_id, TAG_ATTEMPT: "2"})
    log = Log()
    assert link_resume(Writes(instance), resume, log) == failed.run_id
    assert link_resume(Writes(instance), resume, log) == failed.run_id  # a step run again: no repeat
    assert instance.get_run_by_id(failed.run_id).tags[TAG_RESUMED_BY] == resume.run_id
    # Each side names the other, and its metadata is a link the UI opens.
    (event,) = _engine_events(instance, failed)
    assert event.message == f"resumed by run {resume.run_id}, attempt 2"
    assert event.engine_event_data.metadata["resumed_by"] == dg.MetadataValue.dagster_run(
        resume.run_id)
    back = _engine_events(instance, resume)[0]
    assert back.message.startswith(f"resuming failed run {failed.run_id} as attempt 2")
    assert back.engine_event_data.metadata["resumes"] == dg.MetadataValue.dagster_run(
        failed.run_id)
    assert log.entries == []


def test_a_run_that_resumes_nothing_links_nothing(instance):
    run = create_run_for_test(instance, job_name="train_job", tags={PARTITION_TAG: KEY})
    log = Log()
    assert link_resume(Writes(instance), run, log) is None and log.entries == []
