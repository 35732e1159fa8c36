"""Every JSON file a run writes is JSON by the standard (no NaN, no Infinity), so that any
strict parser reads it; what older versions wrote with Infinity still reads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.trainer_proc import run_trainer, write_config
from trainer.api.session import LoopState
from trainer.base import strict_json
from trainer.checkpoints.manifest import Manifest
from trainer.checkpoints.pointer import Best, Pointer


def strict_loads(data: bytes | str):
    """json.loads as a strict parser reads: NaN, Infinity and -Infinity are refused."""
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")
    return json.loads(data, parse_constant=refuse)


def _manifest(**meta) -> Manifest:
    return Manifest(name="step-000000010-a1", step=10, attempt=1,
                    files={"state.pt": {"size": 1, "sha256": "0" * 64}}, parent=None,
                    created_at=1.0, meta=meta, experiment="e", run="r")


def test_a_manifest_with_no_best_yet_and_a_metric_that_overflowed_is_strict_json():
    m = _manifest(best_score=math.inf, metrics={"loss": math.nan, "ppl": -math.inf},
                  loss=0.5)
    raw = strict_loads(m.to_json())
    assert raw["meta"] == {"best_score": None, "metrics": {"loss": None, "ppl": None},
                           "loss": 0.5}
    assert Manifest.from_json(m.to_json(), "here").meta["best_score"] is None


def test_a_pointer_is_strict_json():
    ptr = Pointer(generation=3, checkpoint="step-000000010-a1", step=10, attempt=1,
                  best=Best("step-000000010-a1", math.inf))
    assert strict_loads(ptr.to_json())["best"] == {"checkpoint": "step-000000010-a1",
                                                  "score": None}


def test_manifests_and_pointers_written_with_infinity_before_still_read():
    old = json.dumps({**_manifest(best_score=math.inf).__dict__}).encode()
    assert b"Infinity" in old
    assert Manifest.from_json(old, "old").meta["best_score"] == math.inf
    old_ptr = json.dumps({"generation": 1, "checkpoint": "step-000000010-a1",
                          "best": {"checkpoint": "step-000000010-a1", "score": math.inf}})
    assert Pointer.from_json(old_ptr.encode(), "old").best.score == math.inf


def test_the_loop_reports_no_best_until_there_is_one():
    loop = LoopState()
    assert loop.best is None and loop.best_score == math.inf  # the comparison stays simple
    loop.best_score = 0.25
    assert loop.best == 0.25


def test_strict_dumps_replaces_every_non_finite_float_at_any_depth_and_nothing_else():
    value = {"a": [1, 2.5, math.nan, {"b": (math.inf, "Infinity")}], "c": True, "d": None}
    assert strict_loads(strict_json.dumps(value)) == {
        "a": [1, 2.5, None, {"b": [None, "Infinity"]}], "c": True, "d": None}
    assert strict_json.non_finite_path(value) == ".a[2]"
    assert strict_json.non_finite_path({"a": [1.0, "x"]}) is None


@pytest.mark.slow
def test_every_json_file_a_real_run_writes_parses_strictly_and_old_infinity_resumes(tmp_path):
    store = tmp_path / "store"
    # The checkpoint at step 10 precedes the first evaluation (step 20): no best score yet.
    cfg = write_config(tmp_path / "cfg.json", max_steps=30, eval_every=20,
                       checkpoint={"every_steps": 10, "keep_last": 5, "on_epoch_end": False})
    res = run_trainer(cfg, str(store))
    assert res.returncode == 0, res.log
    written = sorted(p for p in store.rglob("*.json") if p.is_file())
    names = {p.name for p in written}
    assert {"MANIFEST.json", "latest.json"} <= names and len(written) >= 5, names
    for p in written:
        strict_loads(p.read_bytes())  # raises on NaN / Infinity
    ckdir = store / "default" / "equiv" / "checkpoints"
    first = strict_loads((ckdir / "step-000000010-a1" / "MANIFEST.json").read_bytes())
    # Before any evaluation, best follows the loss: a finite number, or null, never Infinity.
    assert first["meta"]["best_score"] is None or math.isfinite(first["meta"]["best_score"])
    later = strict_loads((ckdir / "step-000000020-a1" / "MANIFEST.json").read_bytes())
    assert math.isfinite(later["meta"]["best_score"])

    # A manifest as the trainer wrote it before: Infinity for "no best yet".
    newest = ckdir / "step-000000030-a1" / "MANIFEST.json"
    raw = json.loads(newest.read_bytes())
    raw["meta"]["best_score"] = math.inf
    newest.write_text(json.dumps(raw, indent=1, sort_keys=True))
    longer = write_config(tmp_path / "longer.json", max_steps=40, eval_every=20,
                          checkpoint={"every_steps": 10, "keep_last": 5, "on_epoch_end": False})
    res = run_trainer(longer, str(store))
    assert res.returncode == 0, res.log
    assert "resumed from" in res.log and "at step 30" in res.log
    for p in Path(ckdir).rglob("*.json"):
        if p != newest:
            strict_loads(p.read_bytes())
