"""Typed results from pass to report (issue #30): one Speedup type from the statistics to the report, ctx.time's
answer named as the report names it, ctx.check's per-output accuracy as the report's OutputAccuracy, the pipeline's
own account of a stage as typed fields beside the pass's notes (old stage.json and reports moved over), and the
notes other code reads back through each pass's Notes model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import mlp_recipe, write_recipe

from optimizer.core.metrics import OutputAccuracy, Speedup, TimedComparison, TimedWindow
from optimizer.core.pass_base import Check, PassNotes, PassResult
from optimizer.core.stage import StageRecord, StageReport, split_legacy_notes
from optimizer.measure.accuracy import AccuracyMeter
from optimizer.measure.stats import speedup, speedup_with_spread

WINDOW = {"host": "h", "start": 10.0, "end": 12.5, "pid": 42, "what": "int8_hybrid hybrid timing"}


# ---------------------------------------------------------------- one Speedup, one OutputAccuracy
def test_the_statistics_give_the_report_s_speedup() -> None:
    s = speedup([[2.0, 2.1, 1.9]] * 6, [[1.0, 1.05, 0.95]] * 6)
    assert type(s) is Speedup and s.ratio == pytest.approx(2.0) and s.verdict == "faster"
    assert s.to_json() == {"ratio": s.ratio, "low": s.low, "high": s.high, "verdict": "faster"}
    spread = speedup_with_spread({"a": [[2.0]] * 6, "b": [[1.0]] * 6}, {"a": [0] * 6, "b": [0] * 6}, "a", "b")
    assert type(spread) is Speedup and spread.ratio == pytest.approx(2.0)


def test_ctx_time_s_answer_is_a_speedup_named_ratio() -> None:
    t = TimedComparison(ratio=1.5, low=1.4, high=1.6, verdict="faster", in_run_low=1.45, in_run_high=1.55,
                        p50_ms=2.0, input_p50_ms=3.0, rounds=4, calls=40)
    assert isinstance(t, Speedup) and "speedup" not in t.to_json() and t.to_json()["ratio"] == 1.5


def test_ctx_check_gives_the_report_s_output_accuracy() -> None:
    import numpy as np

    meter = AccuracyMeter(["y"])
    ref = np.array([[1.0, 0.0], [0.0, 1.0]])
    meter.add([ref], [np.array([[1.0, 0.0], [1.0, 1.0]])])
    typed = meter.accuracy()["y"]
    assert isinstance(typed, OutputAccuracy) and typed.to_json() == meter.to_json()["y"]
    assert typed.cosine == pytest.approx(2 / np.sqrt(6)) and typed.max_abs == 1.0  # [1,0,0,1] against [1,0,1,1]


def test_check_worst_reads_typed_outputs() -> None:
    check = Check({
        "a": OutputAccuracy(cosine=0.9, pooled_cosine=0.95),
        "b": OutputAccuracy(cosine=0.99, nonfinite=3),
    })
    assert check.worst() == 0.0  # b has NaN/inf where the reference is finite
    assert check.worst(nonfinite_fails=False) == pytest.approx(0.9)
    assert check.worst("pooled_cosine", output="a") == pytest.approx(0.95)
    assert check.worst("top1", output="a", nonfinite_fails=False) == pytest.approx(0.9)  # no top1: its cosine


# ---------------------------------------------------------------- the pipeline's account, beside the pass's
def test_a_stage_s_pipeline_account_is_typed_fields_not_notes() -> None:
    rec = StageRecord(1, "hybrid", "quantize", "source", status="ran", notes={"mode": "hybrid"})
    assert {"traceback", "error_kind", "cache_note", "pass_timed_windows"}.isdisjoint(rec.to_json())  # as before
    rec.cache_note = "cached folder 01-hybrid was incomplete or changed: rebuilt"
    rec.pass_timed_windows = [TimedWindow.model_validate(WINDOW)]
    report = rec.to_report()
    assert report.notes == {"mode": "hybrid"} and report.cache_note == rec.cache_note
    assert report.pass_timed_windows is not None and report.pass_timed_windows[0].end == 12.5
    assert report.to_json()["pass_timed_windows"] == [WINDOW]
    with pytest.raises(ValueError, match="error_kind"):
        StageReport.model_validate({**report.to_json(), "error_kind": "disk"})


def test_legacy_notes_split_into_the_pass_s_and_the_pipeline_s() -> None:
    notes, moved = split_legacy_notes({"mode": "hybrid", "cache": "rebuilt", "timed_windows": [WINDOW],
                                       "traceback": "Traceback", "error_kind": "input"})
    assert notes == {"mode": "hybrid"}
    assert moved == {"cache_note": "rebuilt", "pass_timed_windows": [WINDOW], "traceback": "Traceback",
                     "error_kind": "input"}


@pytest.mark.slow
def test_a_cached_stage_written_before_the_fields_reads_them_from_its_notes(tmp_path: Path) -> None:
    """stage.json of a stage built by an older version kept the pipeline's keys in its notes: served from the cache,
    they come back as the stage's fields and its notes are the pass's own."""
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import load_recipe

    recipe = load_recipe(write_recipe(tmp_path, mlp_recipe()))
    first = Pipeline(recipe, tmp_path / "out", measure=False).execute()
    assert first[1].status == "ran" and first[1].pass_timed_windows is None  # export times nothing
    stage_json = tmp_path / "out" / "01-export" / "stage.json"
    info = json.loads(stage_json.read_text())
    own = info["notes"]
    info["notes"] = {**own, "timed_windows": [WINDOW], "cache": "an older run's note"}
    stage_json.write_text(json.dumps(info))
    again = Pipeline(recipe, tmp_path / "out", measure=False).execute()
    export = again[1]
    assert export.status == "cached" and export.notes == own
    assert export.pass_timed_windows == [TimedWindow.model_validate(WINDOW)]
    assert export.cache_note == "an older run's note"


# ---------------------------------------------------------------- notes read back through the pass's model
class Counted(PassNotes):
    count: int | None = None


def test_pass_result_notes_are_json_either_way() -> None:
    from optimizer.core.artifact import Artifact

    art = Artifact("onnx", Path("m.onnx"))
    typed = PassResult(art, True, Counted.model_validate({"count": 3, "free": {"a": [1, 2]}}))
    assert typed.notes_json() == {"count": 3, "free": {"a": [1, 2]}}  # given keys only, extras as written
    assert PassResult(art, True, {"count": 3}).notes_json() == {"count": 3}


def _stage(type_: str, notes: dict[str, Any]) -> StageReport:
    return StageReport(index=1, name="s", type=type_, status="ran", notes=notes)


def test_deploy_reads_a_stage_s_precision_through_its_notes_model() -> None:
    from optimizer.deploy.export import _precision

    ov = {"openvino": "2025", "precision": {"asked": "default", "hint": "bf16", "layers": {"bf16": 30, "f32": 2}}}
    assert _precision(_stage("openvino", ov)) == {"mode": "bf16", "hint": "bf16", "layers": {"bf16": 30, "f32": 2}}
    nncf = {"fake_quantize_nodes": 37, "precision": {"asked": "default", "hint": "f32", "layers": {"i8": 36, "f32": 4}}}
    assert _precision(_stage("nncf_int8", nncf)) == {"mode": "int8", "hint": "f32", "layers": {"i8": 36, "f32": 4},
                                                    "fake_quantize_nodes": 37}
    assert _precision(_stage("openvino", {})) == {"mode": "f32", "hint": None, "layers": {}}
    hybrid = {"mode": "hybrid", "int8_nodes": ["mm1", "mm2"], "quantization_ops": {"DynamicQuantizeLinear": 2},
              "decision": "2 of 3 nodes INT8"}
    assert _precision(_stage("quantize", hybrid)) == {"mode": "hybrid", "int8_nodes": ["mm1", "mm2"],
                                                     "quantization_ops": {"DynamicQuantizeLinear": 2}}
    generation = {"prefill": {"mode": "int8_dynamic"}, "decode": {"mode": "int8_dynamic"}}
    assert _precision(_stage("quantize", generation)) == {"mode": None, "int8_nodes": None, "quantization_ops": None}
    assert _precision(_stage("fuse", {"fused_ops": {"Attention": 2}})) == {"mode": "fp32"}


def test_quantize_notes_keep_the_pass_s_whole_account() -> None:
    from passes.quantize.config import QuantizeNotes

    written = {"mode": "int8_static", "calibration": {"samples": 16, "method": "minmax"},
               "reduce_range": {"on": False, "why": "VNNI"}, "quantization_ops": {"QuantizeLinear": 12}}
    notes = QuantizeNotes.model_validate(written)
    assert notes.mode == "int8_static" and notes.quantization_ops == {"QuantizeLinear": 12}
    assert notes.to_json() == written
    pair = QuantizeNotes(prefill=notes, decode=QuantizeNotes.model_validate({"mode": "int8_static"}))
    assert pair.to_json() == {"prefill": written, "decode": {"mode": "int8_static"}}
