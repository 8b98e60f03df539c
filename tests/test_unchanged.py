"""A stage whose pass changed nothing reads "unchanged": it is not timed against an identical model (where noise
alone read as "1.10x slower" with an op-type explanation of a change that never happened), and the stages after
it are timed against the model it passed on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import mlp_recipe, write_recipe

from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import load_recipe
from optimizer.report.build import write_report


def _compile(tmp_path: Path) -> tuple[dict, dict]:
    passes = [
        {"type": "export"},
        {"type": "ort_session"},
        {"type": "fuse", "name": "nothing_to_fuse", "config": {"rules": ["layernorm"]}},  # an MLP has no LayerNorm
        {"type": "ort_session", "name": "after", "config": {"allow_spinning": False}},
    ]
    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe(passes=passes)))
    records = Pipeline(recipe, tmp_path / "out").execute()
    write_report(recipe, records, tmp_path / "out", 0.0)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    return {r.name: r for r in records}, {s["name"]: s for s in report["stages"]}


@pytest.mark.slow
def test_a_pass_that_changes_nothing_reads_unchanged_and_is_not_timed(tmp_path: Path) -> None:
    records, stages = _compile(tmp_path)
    fuse = records["nothing_to_fuse"]
    assert fuse.status == "unchanged", (fuse.status, fuse.reason)
    assert "left its input as it was" in fuse.reason
    assert not fuse.metrics  # no timing, no verdict, no explanation
    assert fuse.artifact == records["ort_session"].artifact  # its input's model is passed on
    assert fuse.notes["rules"]["layernorm"]["fused"] == 0  # the notes say why
    after = records["after"]
    assert after.status == "ran" and after.metrics["scenarios"]["b1"]["vs_parent"]
    assert after.measured_against == "after" and stages["after"]["vs_source"]  # chained through ort_session
    assert stages["nothing_to_fuse"]["status"] == "unchanged" and not stages["nothing_to_fuse"]["vs_source"]
    assert stages["nothing_to_fuse"]["metrics"] is None
    # A rerun reads it from the cache as unchanged again.
    again, _ = _compile(tmp_path)
    assert again["nothing_to_fuse"].status == "unchanged" and again["after"].status == "cached"
