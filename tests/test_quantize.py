"""The quantize pass, mode by mode, on the tiny MLP: numbers against stage 0, and the hybrid's budget logic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import onnx
import pytest
from conftest import mlp_recipe, write_recipe

from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import load_recipe


def run_mode(tmp_path: Path, config: dict[str, Any], **recipe: Any) -> Any:
    data = mlp_recipe(passes=[{"type": "export"}, {"type": "quantize", "config": config}], **recipe)
    # [batch, 4, 16]: Linear layers export as MatMul + Add, which every INT8 mode quantizes.
    data["inputs"] = [{"name": "x", "dtype": "float32", "shape": ["batch", 4, 16]}]
    data["model"]["kwargs"] = {"hidden": 256}
    records = Pipeline(load_recipe(write_recipe(tmp_path, data)), tmp_path / "out").execute()
    assert all(r.ok for r in records), [(r.name, r.reason) for r in records]
    records[-1].notes["export_size"] = records[1].metrics["size_bytes"]
    return records[-1]


def ops(stage: Any) -> dict[str, int]:
    return stage.metrics["graph"]["op_types"]


def test_int8_dynamic(tmp_path: Path) -> None:
    q = run_mode(tmp_path, {"mode": "int8_dynamic"})
    assert ops(q).get("DynamicQuantizeLinear", 0) >= 1
    assert q.metrics["accuracy"]["logits"]["cosine"] > 0.99
    assert q.metrics["size_bytes"] < 0.5 * q.notes["export_size"]  # INT8 weights: a quarter, plus scales


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile"])
def test_int8_static_qdq(tmp_path: Path, method: str) -> None:
    q = run_mode(tmp_path, {"mode": "int8_static", "calibration": {"method": method, "samples": 8}})
    assert ops(q)["QuantizeLinear"] >= 1 and ops(q)["DequantizeLinear"] >= 2  # explicit Q/DQ, as TensorRT takes
    assert q.notes["calibration"]["method"] == method and q.notes["calibration"]["samples"] == 8
    assert q.metrics["accuracy"]["logits"]["cosine"] > 0.98


def test_fp16_keeps_io_types(tmp_path: Path) -> None:
    q = run_mode(tmp_path, {"mode": "fp16"})
    model = onnx.load(str(q.artifact.path))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer)
    acc = q.metrics["accuracy"]["logits"]
    assert acc["cosine"] > 0.9999 and 0 < acc["max_abs"] < 0.05


def test_hybrid_chooses_int8_within_budget(tmp_path: Path) -> None:
    q = run_mode(tmp_path, {"mode": "hybrid", "calibration": {"samples": 4}, "hybrid": {"min_cosine": 0.99}})
    assert q.notes["int8_nodes"], q.notes["decision"]
    table = json.loads((q.artifact.path.parent / "sensitivity.json").read_text())
    assert {r["node"] for r in table} == set(q.notes["int8_nodes"]) | set(q.notes["fp32_nodes"])
    assert all(r["sensitivity"] >= 0 for r in table)
    search = json.loads((q.artifact.path.parent / "hybrid_search.json").read_text())
    points = search["accuracy_points"]
    assert points and all(0 < p["cosine"] <= p["cosine_mean"] <= 1 + 1e-9 for p in points)  # worst <= mean
    # Each timed set ran interleaved with the FP32 input under the harness: a ratio inside its interval.
    assert search["timings"] and all(0 < t["low"] <= t["speedup"] <= t["high"] for t in search["timings"])
    assert all(t["calls"] >= 4 * 3 and t["input_p50_ms"] > 0 for t in search["timings"])
    chosen = len(q.notes["int8_nodes"])
    assert chosen in {t["int8_nodes"] for t in search["timings"]}, search["decision"]
    assert q.metrics["accuracy"]["logits"]["cosine"] > 0.99


def test_hybrid_budget_too_tight_keeps_fp32(tmp_path: Path) -> None:
    q = run_mode(
        tmp_path, {"mode": "hybrid", "calibration": {"samples": 4}, "hybrid": {"min_cosine": 0.99999999, "margin": 0.0}}
    )
    assert q.notes["int8_nodes"] == []
    assert "every node kept in FP32" in q.notes["decision"]
    assert "DynamicQuantizeLinear" not in ops(q)
    assert q.metrics["accuracy"]["logits"]["cosine"] > 0.999999


def test_budget_rejects_a_stage(tmp_path: Path) -> None:
    q = run_mode(tmp_path, {"mode": "int8_dynamic"}, accuracy={"metric": "max_abs", "max": 1e-9, "samples": 2})
    assert q.metrics["within_budget"] is False and "> 1e-09" in q.metrics["budget"]
