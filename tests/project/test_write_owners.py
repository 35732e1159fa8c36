"""The lifecycle table drives who changes a training run. Every write to a run (its tags,
its end, its termination, its decision, its state observation) is made in one module,
`lifecycle/transition.py`, whose `transition` derives the run's state and takes the table's
row before the owner writes; and a module moves a run by an event only where the table
(`ckpt_assets.lifecycle.model.TABLE`) names it as that event's owner. A write added
anywhere else, or a move by another module, fails here."""

from __future__ import annotations

import ast
from pathlib import Path

from ckpt_assets.lifecycle.model import TABLE, Event

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ckpt_assets"
MOVER = "lifecycle.transition"

# The calls that change a run, however spelled (a method of the instance or its launcher,
# a function of ours): tags, its end, a decision, a state observation or check; and the
# object that makes them, which only `transition` hands out.
WRITES = frozenset({
    "add_run_tags", "delete_run_tags", "report_run_failed", "report_run_canceled",
    "report_run_canceling", "terminate", "create_once", "report_runless_asset_event",
    "state_observation", "state_check_evaluation", "Writes",
})
# Modules that write without moving a training run through the table, each with why.
NOT_MOVES = {
    # Tags of its own job's run (a stop's or a registration's target), never a training run.
    "defs.jobs": "tags the stop job's and the new-run job's own runs",
    # The attempt's process identity (ckpt/processes), read to stop them; not a state.
    "attempt.process": "records the attempt's own processes for whoever stops them",
}
# Events that no `transition` records, each with why: they write nothing to a run's state.
NOT_RECORDED = {
    Event.LAUNCHED: "a new run is submitted; `runs.submit` writes no run it does not create",
    Event.CHECKPOINT_COMMITTED: "history on the partition (an observation per checkpoint), "
                                "no change of state: no derivation on every commit",
    Event.ATTEMPT_ENDED: "the attempt's own record, logged even after the reconciler ended "
                         "its run; the step's failure ends the run by Dagster",
    Event.TERMINATED: "Dagster's own move: nothing is written until the attempt ends",
    Event.BACKOFF_DUE: "a RunRequest of the reconciler: Dagster launches it",
    Event.RESUME_LAUNCHED: "a RunRequest of the reconciler: Dagster launches it",
}


def _modules(package: Path):
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package).with_suffix("").parts)
        yield path, module, ast.parse(path.read_text())


def _name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)


def writes_outside_transition(package: Path) -> list[str]:
    found = []
    for path, module, tree in _modules(package):
        if module == MOVER or module in NOT_MOVES:
            continue
        found += [f"{path.relative_to(package)}:{node.lineno} {_name(node)}"
                  for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and _name(node) in WRITES]
    return found


def moves(package: Path) -> dict[str, set[Event]]:
    """{module: the events it moves a run by}: the `Event.X` named in a function that calls
    `transition` (the event given, or chosen there, as the decision chooses its own)."""
    found: dict[str, set[Event]] = {}
    for _, module, tree in _modules(package):
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef) or not any(
                    isinstance(n, ast.Call) and _name(n) == "transition" for n in ast.walk(fn)):
                continue
            found.setdefault(module, set()).update(
                Event[n.attr] for n in ast.walk(fn) if isinstance(n, ast.Attribute)
                and getattr(n.value, "id", "") == "Event")
    return found


def moves_by_others(package: Path) -> list[str]:
    owner = {(t.owner, t.event) for t in TABLE}
    return sorted(f"{module} moves by {event.name}" for module, events in moves(package).items()
                  for event in events if (module, event) not in owner)


def test_every_write_to_a_run_is_made_through_transition():
    assert writes_outside_transition(PACKAGE) == []


def test_a_run_is_moved_by_an_event_only_by_the_events_owner_in_the_table():
    assert moves_by_others(PACKAGE) == []


def test_every_event_that_changes_a_run_is_recorded_through_transition_by_its_owner():
    moved = {(module, e) for module, events in moves(PACKAGE).items() for e in events}
    unmoved = {(t.owner, t.event.name) for t in TABLE
               if t.event not in NOT_RECORDED and (t.owner, t.event) not in moved}
    assert unmoved == set()


def test_a_write_or_a_move_added_outside_its_owner_is_found(tmp_path):
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "listing.py").write_text(
        "def show(instance, run):\n"
        "    instance.add_run_tags(run.run_id, {'ckpt/decision': 'stop'})  # a read that writes\n"
        "    transition(instance, 'r', Event.DECIDED_STOP)  # and moves\n")
    (tmp_path / "lifecycle").mkdir()
    (tmp_path / "lifecycle" / "transition.py").write_text(
        "def fail(instance, run):\n    instance.report_run_failed(run, 'why')\n")
    (tmp_path / "lifecycle" / "stop.py").write_text(
        "def stop(instance):\n    transition(instance, 'r', Event.STOP_REQUESTED)\n")
    assert writes_outside_transition(tmp_path) == ["records/listing.py:2 add_run_tags"]
    assert moves_by_others(tmp_path) == ["records.listing moves by DECIDED_STOP"]


def test_the_modules_that_write_without_a_move_are_not_owners_of_one_too():
    assert not set(NOT_MOVES) & {t.owner for t in TABLE}
