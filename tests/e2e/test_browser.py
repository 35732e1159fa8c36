"""What a user reads in the Dagster UI, in a real browser, after a real auto-resume.

`dagster dev` (webserver + daemon) runs on a temporary instance; two training runs are
launched the way the README says (`python -m ckpt_assets launch`): `preempted`, whose
trainer is sent SIGTERM mid-run and which the resume sensor resumes to the end, and
`buggy`, whose task raises (exit 1: a bug, not resumed); a third, `halted`, is started from
the launchpad (`new_training_run`) and stopped for good with a reason. A headless Chromium
(Debian's `/usr/bin/chromium`, driven by Playwright) then reads the asset graph, the
launchpad, the runs' pages, the checkpoint events, the partitions view, the state check and
the final model.

Screenshots of every page checked (and of the page where a failing test stopped, named
`...-FAILED.png`) are written to test-artifacts/browser/, with the `dagster dev` log.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys

import dagster as dg
import pytest

from ckpt_assets.defs.resources import MLFLOW_UI_URL_ENV
from ckpt_assets.lifecycle.settings import Setting
from ckpt_assets.records.history import BARS, RESUME_MARK
from tests.browser_harness import (
    ARTIFACTS,
    CHROMIUM,
    browser_required,
    missing_browser,
    safe_name,
    start_dagster_dev,
)
from tests.daemon_harness import ROOT, kill, training_config

pytestmark = [pytest.mark.slow, pytest.mark.browser]

# Generous: a busy 2-core machine renders the UI slowly, and runs take their time.
UI_TIMEOUT_MS = 60_000
RUN_TIMEOUT_S = 360
CHECKPOINT_RE = r"checkpoint step (\d+) committed \(loss ([0-9.eE+-]+|nan|inf)\)"
MLFLOW_UI = "http://127.0.0.1:5000"  # where metadata links to MLflow (no server needed)
HALTED = "halted"  # started from the launchpad, then stopped for good with a reason
STOP_REASON = "wrong lr"


@pytest.fixture(scope="module")
def browser():
    why = missing_browser()
    if why is not None:
        if browser_required():
            pytest.fail(f"{why} (as root with apt, scripts/setup.sh installs it)")
        pytest.skip(why)
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=UI_TIMEOUT_MS)
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    print(f"\nbrowser test screenshots: {ARTIFACTS}")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def scenario(browser, tmp_path_factory):
    """`dagster dev` with two runs launched and `preempted` preempted; not waited for."""
    work = tmp_path_factory.mktemp("browser")
    dev, url = start_dagster_dev(work, str(work / "store"),
                                 # `preempted` is resumed as a new run by the sensors
                                 # (in-run, its trainer SIGTERMed alone would train on).
                                 extra_env={MLFLOW_UI_URL_ENV: MLFLOW_UI,
                                            Setting.IN_RUN_RELAUNCH.value: "0"})
    try:
        # The bug first: `preempted` must still be training when it is looked for.
        _launch(dev, "buggy", training_config("buggy", task_args={"fail_at_step": 12}), work)
        _launch(dev, "preempted", training_config("preempted"), work)
        hb = dev.wait_for_step("preempted", 15, attempt=1, timeout=RUN_TIMEOUT_S)
        assert hb["step"] < 55, f"too late to preempt: {hb}"
        kill(int(hb["pid"]), signal.SIGTERM)
        yield dev, url
    finally:
        dev.stop()
        shutil.copy(dev.log_path, ARTIFACTS / "dagster-dev.log")


def _launch(dev, name: str, cfg: dict, work) -> None:
    path = work / f"{name}.json"
    path.write_text(json.dumps(cfg))
    res = subprocess.run([sys.executable, "-m", "ckpt_assets", "launch", name, "--config",
                          str(path)], cwd=ROOT, env=dev.env, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
    assert res.returncode == 0, res.stdout + res.stderr


def _training_runs(dev, partition: str) -> list:
    """The partition's train_job runs, oldest first (other jobs, e.g. checks, are tagged with
    the partition too)."""
    return [r for r in dev.runs(partition) if r.job_name == "train_job"]


@pytest.fixture(scope="module")
def settled(scenario):
    """Both runs have ended as they should: run ids of what the pages will show."""
    dev, url = scenario

    def resumed_and_done():
        runs = _training_runs(dev, "preempted")
        return runs if len(runs) >= 2 and runs[-1].status.value == "SUCCESS" else None

    first, *rest = dev.wait_until(resumed_and_done, "the preempted run to be resumed to the end",
                                  timeout=RUN_TIMEOUT_S)
    assert [r.tags.get("ckpt/parent_run_id") for r in rest] == [first.run_id], \
        [(r.run_id, r.status.value, r.tags) for r in rest]
    (resume,) = rest
    assert first.tags.get("ckpt/decision") == "resume", first.tags
    dev.wait_until(lambda: dev.instance.get_run_by_id(first.run_id).tags.get(
        "ckpt/resumed_by") == resume.run_id, "the resume to link itself", timeout=60)
    bug = dev.wait_until(lambda: next((r for r in _training_runs(dev, "buggy")
                                       if "ckpt/decision" in r.tags), None),
                         "a decision on the buggy run", timeout=RUN_TIMEOUT_S)
    assert (bug.tags["ckpt/decision"], bug.tags["ckpt/failure_kind"]) == ("stop", "bug"), \
        bug.tags
    return {"url": url, "preempted": first.run_id, "resume": resume.run_id,
            "buggy": bug.run_id}


class Shots:
    """Numbered full-page screenshots of one test, under test-artifacts/browser/."""

    def __init__(self, page, test_name: str):
        self.page, self.prefix, self.n = page, safe_name(test_name.removeprefix("test_")), 0

    def __call__(self, label: str) -> None:
        self.n += 1
        path = ARTIFACTS / f"{self.prefix}-{self.n:02d}-{safe_name(label)}.png"
        try:
            self.page.screenshot(path=str(path), full_page=True)
        except Exception as e:  # a screenshot must never hide the test's own outcome
            print(f"screenshot {path.name} failed: {e}")


@pytest.fixture
def page(browser, request):
    context = browser.new_context(viewport={"width": 1440, "height": 1100})
    context.set_default_timeout(UI_TIMEOUT_MS)
    pg = context.new_page()
    shots = Shots(pg, request.node.name)
    pg.shots = shots
    failed_before = request.session.testsfailed
    yield pg
    if request.session.testsfailed > failed_before:  # the page where the test stopped
        shots("FAILED")
        print(f"screenshots: {ARTIFACTS}")
    context.close()


def _open_run(page, base: str, run_id: str, log_filter: str):
    """A run's page, its event log filtered by text the way a user types it."""
    page.goto(f"{base}/runs/{run_id}")
    box = page.get_by_placeholder("Filter…")
    box.fill(log_filter)


# -- what needs no finished run (checked while the runs go on) -------------------------------

def test_the_asset_graph_shows_the_three_training_assets(scenario, page):
    from playwright.sync_api import expect

    _, url = scenario
    page.goto(f"{url}/asset-groups")
    graph = page.locator("svg foreignObject")
    # All three are partitioned by training run: two partitions, once both are registered.
    # Node by node: the UI refetches each node's partition counts while runs go on, and on a
    # busy machine a node shows its placeholder again before the last one has loaded.
    for name in ("training_dataset", "model_checkpoint", "final_model"):
        node = graph.filter(has=page.get_by_text(name, exact=True))
        expect(node.first).to_be_visible()
        expect(node.get_by_text("2 partitions", exact=True).first).to_be_visible()
    page.shots("asset-graph")


def test_the_launchpad_refuses_an_unknown_key_in_the_training_config(scenario, page):
    from playwright.sync_api import expect

    _, url = scenario
    page.goto(f"{url}/locations/ckpt_assets/jobs/train_job/playground")
    partition = page.get_by_placeholder("Partition")
    chosen = page.get_by_text("partition: buggy", exact=True)
    # The picker takes Enter only once it has loaded the partitions (slow on a busy machine).
    for _ in range(5):
        partition.fill("buggy")
        partition.press("Enter")
        try:
            expect(chosen).to_be_visible(timeout=10_000)
            break
        except AssertionError:
            partition.fill("")
    expect(chosen).to_be_visible()
    editor = page.locator(".CodeMirror").first
    launch = page.get_by_role("button", name="Launch Run")

    def type_config(training_yaml: str) -> None:
        editor.click()
        page.keyboard.press("Control+A")
        page.keyboard.insert_text("ops:\n  training_dataset:\n    config:\n      training:\n"
                                  f"        {training_yaml}\n")

    type_config("max_steps: 5")
    expect(page.get_by_text("No errors", exact=True)).to_be_visible()
    expect(launch).to_be_enabled()
    page.shots("launchpad-valid")
    type_config("max_stepz: 5")
    expect(page.get_by_text(re.compile(
        r'Received unexpected config entry "max_stepz" at path '
        r"root:ops:training_dataset:config:training"))).to_be_visible()
    expect(launch).to_be_disabled()
    page.shots("launchpad-max_stepz-refused")


# -- what the runs left behind ----------------------------------------------------------------

def test_the_preempted_runs_page_says_it_is_resumed_and_by_which_run(settled, page):
    from playwright.sync_api import expect

    url, first, resume = settled["url"], settled["preempted"], settled["resume"]
    _open_run(page, url, first, "Resuming now")
    expect(page.get_by_text("Failure", exact=True).first).to_be_visible()
    expect(page.get_by_text(re.compile(r"^Resuming now \(preempted\): "))).to_be_visible()
    page.shots("preempted-decision")
    _open_run(page, url, first, "resumed by run")
    expect(page.get_by_text(f"resumed by run {resume}", exact=False)).to_be_visible()
    # ... and a link that opens it.
    expect(page.locator(f"a[href*='/runs/{resume}']").first).to_be_visible()
    page.shots("preempted-resumed-by")
    # The resume's page (where that id leads): it succeeded, and says what it resumed.
    _open_run(page, url, resume, "resuming failed run")
    expect(page.get_by_text("Success", exact=True).first).to_be_visible()
    expect(page.get_by_text(f"resuming failed run {first}", exact=False)).to_be_visible()
    expect(page.locator(f"a[href*='/runs/{first}']").first).to_be_visible()
    page.shots("resume-run")


def test_the_buggy_runs_page_says_it_is_not_resumed_and_why(settled, page):
    from playwright.sync_api import expect

    _open_run(page, settled["url"], settled["buggy"], "Not resumed")
    expect(page.get_by_text("Failure", exact=True).first).to_be_visible()
    expect(page.get_by_text(re.compile(
        r"^Not resumed \(bug\): .*exception in the training code"))).to_be_visible()
    page.shots("buggy-decision")


def _partition_event(page, url: str, partition: str, description: str) -> str:
    """Click through the model_checkpoint events of `partition` (newest first) until one
    whose description matches the regex `description` is shown; return that description."""
    from playwright.sync_api import expect

    page.goto(f"{url}/assets/model_checkpoint?view=events")
    rows = page.locator("[data-index]").filter(has=page.get_by_text(partition, exact=True))
    expect(page.locator("[data-index]").first).to_be_visible()
    wanted = page.get_by_text(re.compile(description))
    header = page.get_by_text(re.compile(f"^Partition {partition} (observed|materialized)"))
    # A quick look at each event first; then, in case the page is slow to show the one
    # clicked, a patient one.
    for patience_ms in (0, 5000):
        for _ in _list_scrolled(page):
            for i in range(rows.count()):
                _show(rows.nth(i), header)
                try:
                    if patience_ms:
                        expect(wanted).to_be_visible(timeout=patience_ms)
                    elif not wanted.is_visible():
                        continue
                except AssertionError:
                    continue
                return wanted.inner_text().strip()
    raise AssertionError(f"no event of {partition} reads {description!r} among its "
                         f"{rows.count()} model_checkpoint events shown")


# The events list's scrolling box: the nearest ancestor of a row that scrolls.
_SCROLLER = """row => { let box = row.parentElement;
    while (box && !['auto', 'scroll'].includes(getComputedStyle(box).overflowY))
        box = box.parentElement;
    return box; }"""


def _list_scrolled(page, step_px: int = 300):
    """Yield once as the events list stands, then once per scroll position from its top to
    its bottom: it is virtualized, so only the rows near its view exist in the page, and
    the rows of a partition whose events are older than many others' are not among them."""
    yield
    first = page.locator("[data-index]").first
    height = first.evaluate(f"row => {{ const box = ({_SCROLLER})(row); "
                            "return box ? box.scrollHeight : 0; }")
    for top in range(0, height + step_px, step_px):
        first.evaluate(f"(row, top) => {{ const box = ({_SCROLLER})(row); "
                       "if (box) box.scrollTop = top; }", top)
        yield


def _show(row, header) -> None:
    """Show `row`'s event: scrolled to the middle of the list first. The events list is
    virtualized; a row at the bottom edge, clicked where Playwright saw it, moved as the list
    settled, and the click selected the row above it (another partition's event)."""
    from playwright.sync_api import expect

    row.evaluate("e => e.scrollIntoView({block: 'center'})")
    row.click()
    expect(header).to_be_visible()


def test_each_checkpoint_event_reads_its_step_and_loss(settled, page):
    from playwright.sync_api import expect

    url = settled["url"]
    # The last checkpoint of the resumed run, and the one the buggy run committed.
    for partition, step in (("preempted", 60), ("buggy", 10)):
        text = _partition_event(page, url, partition,
                                f"^checkpoint step {step} committed \\(loss ")
        m = re.fullmatch(CHECKPOINT_RE, text)
        assert m and int(m.group(1)) == step, text
        # The event's metadata says the same: its loss is in the table next to it.
        expect(page.get_by_text(m.group(2), exact=True).first).to_be_visible()
        page.shots(f"{partition}-checkpoint-{step}")


def test_the_partitions_view_shows_the_bug_as_failed_and_the_resumed_run_as_materialized(
        settled, page):
    from playwright.sync_api import expect

    page.goto(f"{settled['url']}/assets/model_checkpoint?view=partitions")
    failed = page.get_by_text(re.compile(r"^Failed \(\d+\)$"))
    materialized = page.get_by_text(re.compile(r"^Materialized \(\d+\)$"))
    expect(page.get_by_text("buggy", exact=True).first).to_be_visible()
    page.shots("partitions-all")
    # Only the failed ones: the bug, not the resumed run.
    materialized.click()
    expect(page.get_by_text("buggy", exact=True).first).to_be_visible()
    expect(page.get_by_text("preempted", exact=True)).to_have_count(0)
    page.get_by_text("buggy", exact=True).first.click()
    expect(page.get_by_text(f"Run {settled['buggy'][:8]} failed, and did not materialize "
                            "this asset.")).to_be_visible()
    expect(page.get_by_text("Materialized", exact=True)).to_have_count(0)  # no such badge
    page.shots("partitions-failed")
    # Only the materialized ones: the resumed run, not the bug.
    page.goto(f"{settled['url']}/assets/model_checkpoint?view=partitions")
    failed.click()
    expect(page.get_by_text("preempted", exact=True).first).to_be_visible()
    expect(page.get_by_text("buggy", exact=True)).to_have_count(0)
    page.get_by_text("preempted", exact=True).first.click()
    expect(page.get_by_text("Materialized", exact=True)).to_be_visible()  # the badge
    expect(page.get_by_text("Latest materialization")).to_be_visible()
    expect(page.get_by_text(settled["resume"][:8], exact=True).first).to_be_visible()
    page.shots("partitions-materialized")


def test_each_partition_reads_its_training_runs_state_and_why(settled, page):
    url = settled["url"]
    text = _partition_event(page, url, "buggy", r"^state: stopped by policy: not resumed: ")
    assert "exception in the training code" in text, text
    page.shots("buggy-state")
    _partition_event(page, url, "preempted", r"^state: finished: attempt 2 trained to step 60$")
    page.shots("preempted-state")


# -- the state, the preemption, the final model, the launchpad, the stop ----------------------

def _type_config(page, yaml_text: str) -> None:
    page.locator(".CodeMirror").first.click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(yaml_text)


@pytest.fixture(scope="module")
def halted(scenario, browser):
    """`halted` launched from new_training_run's launchpad, then stopped with a reason once
    its train_job run has started: (the launcher run's id, the stopped train_job run's id)."""
    from playwright.sync_api import expect

    dev, url = scenario
    context = browser.new_context(viewport={"width": 1440, "height": 1100})
    context.set_default_timeout(UI_TIMEOUT_MS)
    page = context.new_page()
    try:
        page.goto(f"{url}/locations/ckpt_assets/jobs/new_training_run/playground")
        training = json.dumps(training_config(HALTED, max_steps=400))
        _type_config(page, "ops:\n  new_training_run_op:\n    config:\n"
                           f"      name: {HALTED}\n      training: {training}\n")
        expect(page.get_by_text("No errors", exact=True)).to_be_visible()
        Shots(page, "new_training_run")("launchpad")
        page.get_by_role("button", name="Launch Run").click()
        (queued,) = dev.wait_until(lambda: _training_runs(dev, HALTED) or None,
                                   "the launchpad's run to queue train_job for it",
                                   timeout=RUN_TIMEOUT_S)
    finally:
        context.close()
    # Stopped once it runs: a run canceled while still queued never started, and the
    # partitions view says nothing of it (no "failed" line), which is not what is looked at.
    dev.wait_until(lambda: dev.instance.get_run_by_id(queued.run_id).status
                   == dg.DagsterRunStatus.STARTED or None,
                   "the stopped run to start", timeout=RUN_TIMEOUT_S)
    res = subprocess.run([sys.executable, "-m", "ckpt_assets", "stop", HALTED, "--reason",
                          STOP_REASON], cwd=ROOT, env=dev.env, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S)
    assert res.returncode == 0, res.stdout + res.stderr
    decided = dev.wait_until(lambda: next((r for r in _training_runs(dev, HALTED)
                                           if "ckpt/decision" in r.tags), None),
                             "a decision on the stopped run", timeout=RUN_TIMEOUT_S)
    assert decided.run_id == queued.run_id and decided.tags["ckpt/decision"] == "stop"
    (launcher,) = dev.instance.get_runs(filters=dg.RunsFilter(job_name="new_training_run"))
    return {"launcher": launcher.run_id, "run": queued.run_id}


def test_a_run_stopped_for_good_reads_stopped_with_its_reason_in_its_state_check(
        settled, halted, page):
    from playwright.sync_api import expect

    page.goto(f"{settled['url']}/assets/model_checkpoint?view=checks"
              "&checkDetail=training_run_state")
    page.get_by_role("tab", name="Execution history").click()
    expect(page.get_by_text(f"stopped by user: stopped on request ({STOP_REASON})",
                            exact=True).first).to_be_visible()
    # Apart from the bug the policy stopped, and from the run that resumed to the end.
    expect(page.get_by_text(re.compile(r"^stopped by policy: not resumed: an exception in the "
                                       "training code")).first).to_be_visible()
    expect(page.get_by_text(re.compile(r"^finished: attempt 2 finished the run, after 1 "
                                       r"interrupted attempt\(s\): it resumed from "))
           .first).to_be_visible()
    page.shots("halted-state-check")


def test_the_preempted_step_failure_reads_as_a_preemption_with_its_resume(settled, page):
    from playwright.sync_api import expect

    # The text filter reads an event's message and metadata: the step failure's message is
    # Dagster's; our description is its error, shown on the row.
    _open_run(page, settled["url"], settled["preempted"],
              'Execution of step "model_checkpoint" failed')
    expect(page.get_by_text(re.compile(
        r"preempted, not a bug: the training process exited 143 \(SIGTERM\) in attempt 1 "
        r".*To be resumed at once")).first).to_be_visible()
    page.shots("preempted-step-failure")


def test_the_resumed_runs_final_model_shows_its_history_and_links_to_mlflow(settled, page):
    from playwright.sync_api import expect

    page.goto(f"{settled['url']}/assets/final_model?view=partitions")
    page.get_by_text("preempted", exact=True).first.click()
    expect(page.get_by_text("Latest materialization")).to_be_visible()
    for key in ("metrics_history", "loss_plot", "loss_plot_image", "mlflow_run_link"):
        expect(page.get_by_text(key, exact=True).first).to_be_visible()
    # The loss curve itself reads in the metadata table, no toggle opened: a bar per
    # checkpoint, the resume marked.
    expect(page.get_by_text(re.compile(f"[{BARS}]+{RESUME_MARK}[{BARS}]+")).first) \
        .to_be_visible()
    # A resumed run reads apart from an uninterrupted one.
    expect(page.get_by_text(re.compile(r"^attempt 2 from step \d+$")).first).to_be_visible()
    expect(page.locator(f"a[href^='{MLFLOW_UI}/#/experiments/']").first).to_be_visible()
    page.shots("final-model-history")


def test_the_launchpad_run_names_the_train_job_run_it_started(settled, halted, page):
    from playwright.sync_api import expect

    _open_run(page, settled["url"], halted["launcher"], HALTED)
    expect(page.get_by_text(re.compile(f"training run '{HALTED}' .*launched: train_job run "
                                       f"{halted['run']}")).first).to_be_visible()
    # ... and its output links to it.
    _open_run(page, settled["url"], halted["launcher"], "Yielded output")
    expect(page.locator(f"a[href*='/runs/{halted['run']}']").first).to_be_visible()
    page.shots("launcher-run")


def test_the_stopped_runs_page_says_it_is_not_resumed_and_the_users_reason(
        settled, halted, page):
    from playwright.sync_api import expect

    _open_run(page, settled["url"], halted["run"], "Not resumed")
    expect(page.get_by_text(re.compile(r"^Not resumed \(stopped_by_user\): stopped on "
                                       rf"request \({re.escape(STOP_REASON)}\)"))
           .first).to_be_visible()
    page.shots("halted-decision")




def test_a_stopped_partition_reads_canceled_there_and_its_stop_and_reason_in_its_events(
        settled, halted, page):
    # Dagster 1.13's partitions view has a partition's materialization status only (its
    # "historical events" are materializations): a user's stop is a canceled run there, not
    # a failed one as a bug's is; the state and its reason are the partition's events and
    # its state check (docs/dagster.md).
    from playwright.sync_api import expect

    page.goto(f"{settled['url']}/assets/model_checkpoint?view=partitions")
    page.get_by_text(HALTED, exact=True).first.click()
    expect(page.get_by_text(f"Run {halted['run'][:8]} was canceled, and did not materialize "
                            "this asset.")).to_be_visible()
    page.shots("halted-partition")
    _partition_event(page, settled["url"], HALTED,
                     rf"^state: stopped by user: stopped on request \({STOP_REASON}\)")
    page.shots("halted-state")
