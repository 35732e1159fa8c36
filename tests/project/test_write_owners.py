"""The lifecycle table names who may change a training run: a write to a run (its tags, its
end, its decision, its state observation) is made only in a module that the table
(`ckpt_assets.lifecycle.model.TABLE`) names as the owner of some move. A write added
anywhere else fails here, so the table is read by the code's own test, not a comment."""

from __future__ import annotations

import ast
from pathlib import Path

from ckpt_assets.lifecycle.model import TABLE

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ckpt_assets"

# The calls that change a run, however spelled (a method of the instance or its launcher,
# a function of ours): tags, its end, a decision, a state observation or check.
WRITES = frozenset({
    "add_run_tags", "delete_run_tags", "report_run_failed", "report_run_canceled",
    "report_run_canceling", "terminate", "create_once", "report_state",
    "report_runless_asset_event", "state_observation", "state_check_evaluation",
})
# Modules that write without moving a training run through the table, each with why.
NOT_MOVES = {
    # The observation and check an owner asks for are built and written here, on its behalf.
    "lifecycle.state": "writes the state observation and check an owner's move records",
    # Tags of its own job's run (a stop's or a registration's target), never a training run.
    "defs.jobs": "tags the stop job's and the new-run job's own runs",
    # The attempt's process identity (ckpt/processes), read to stop them; not a state.
    "attempt.process": "records the attempt's own processes for whoever stops them",
}


def owners() -> set[str]:
    return {t.owner for t in TABLE}


def writes_outside_the_owners(package: Path, allowed: set[str]) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package).with_suffix("").parts)
        if module in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in WRITES:
                found.append(f"{path.relative_to(package)}:{node.lineno} {name}")
    return found


def test_every_write_to_a_run_is_made_by_an_owner_the_lifecycle_table_names():
    assert writes_outside_the_owners(PACKAGE, owners() | set(NOT_MOVES)) == []


def test_a_write_added_outside_the_owners_is_found(tmp_path):
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "listing.py").write_text(
        "def show(instance, run):\n"
        "    instance.add_run_tags(run.run_id, {'ckpt/decision': 'stop'})  # a read that writes\n")
    (tmp_path / "lifecycle").mkdir()
    (tmp_path / "lifecycle" / "stop.py").write_text(
        "def stop(instance, run):\n    instance.report_run_canceled(run)\n")
    assert writes_outside_the_owners(tmp_path, owners() | set(NOT_MOVES)) == [
        "records/listing.py:2 add_run_tags"]


def test_the_modules_that_write_without_a_move_are_not_owners_of_one_too():
    assert not set(NOT_MOVES) & owners()
