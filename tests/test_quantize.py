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


@pytest.mark.slow
def test_int8_dynamic(tmp_path: Path) -> None:
    q = run_mode(tmp_path, {"mode": "int8_dynamic"})
    assert ops(q).get("DynamicQuantizeLinear", 0) >= 1
    assert q.metrics["accuracy"]["logits"]["cosine"] > 0.99
    assert q.metrics["size_bytes"] < 0.5 * q.notes["export_size"]  # INT8 weights: a quarter, plus scales


@pytest.mark.slow
@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile"])
def test_int8_static_qdq(tmp_path: Path, method: str) -> None:
    q = run_mode(tmp_path, {"mode": "int8_static", "calibration": {"method": method, "samples": 8}})
    assert ops(q)["QuantizeLinear"] >= 1 and ops(q)["DequantizeLinear"] >= 2  # explicit Q/DQ, as TensorRT takes
    assert q.notes["calibration"]["method"] == method and q.notes["calibration"]["samples"] == 8
    assert q.metrics["accuracy"]["logits"]["cosine"] > 0.98


@pytest.mark.slow
def test_fp16_keeps_io_types(tmp_path: Path) -> None:
    q = run_mode(tmp_path, {"mode": "fp16"})
    model = onnx.load(str(q.artifact.path))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer)
    acc = q.metrics["accuracy"]["logits"]
    assert acc["cosine"] > 0.9999 and 0 < acc["max_abs"] < 0.05


@pytest.mark.slow
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
    assert search["timings"] and all(0 < t["low"] <= t["ratio"] <= t["high"] for t in search["timings"])
    assert all(t["calls"] >= 4 * 3 and t["input_p50_ms"] > 0 for t in search["timings"])
    chosen = len(q.notes["int8_nodes"])
    assert chosen in {t["int8_nodes"] for t in search["timings"]}, search["decision"]
    assert q.metrics["accuracy"]["logits"]["cosine"] > 0.99


@pytest.mark.slow
def test_hybrid_budget_too_tight_keeps_fp32(tmp_path: Path) -> None:
    q = run_mode(
        tmp_path, {"mode": "hybrid", "calibration": {"samples": 4}, "hybrid": {"min_cosine": 0.99999999, "margin": 0.0}}
    )
    assert q.notes["int8_nodes"] == []
    assert "every node kept in FP32" in q.notes["decision"]
    assert "DynamicQuantizeLinear" not in ops(q)
    assert q.metrics["accuracy"]["logits"]["cosine"] > 0.999999


@pytest.mark.slow
def test_budget_rejects_a_stage(tmp_path: Path) -> None:
    q = run_mode(tmp_path, {"mode": "int8_dynamic"}, accuracy={"metric": "max_abs", "max": 1e-9, "samples": 2})
    assert q.metrics["within_budget"] is False and "> 1e-09" in q.metrics["budget"]


def fused_conv_graph(activation: str | None, params: list[float], bias: bool, residual: bool, opset: int) -> Any:
    """One com.microsoft.FusedConv, as the fuse pass (or ORT's own optimizer) writes it."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(4, 4, 3, 3)).astype(np.float32), "w")]
    inputs = ["x", "w"]
    if bias or residual:
        inputs.append("b" if bias else "")
        if bias:
            inits.append(numpy_helper.from_array(rng.normal(size=4).astype(np.float32), "b"))
    if residual:
        inputs.append("z")
    attrs: dict[str, Any] = {"pads": [1, 1, 1, 1]}
    if activation:
        attrs |= {"activation": activation, "activation_params": params} if params else {"activation": activation}
    node = helper.make_node("FusedConv", inputs, ["y"], name="conv_Fused", domain="com.microsoft", **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4, 6, 6]) for n in ("x", "z")[: 1 + residual]],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
        inits,
    )
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize(
    ("activation", "params", "bias", "residual", "opset", "written"),
    [
        ("Relu", [], True, False, 17, ["Conv", "Relu"]),
        ("Relu", [], False, True, 17, ["Conv", "Add", "Relu"]),  # Conv + residual Add + Relu, as `fuse` writes it
        (None, [], True, True, 17, ["Conv", "Add"]),
        ("Clip", [0.0, 6.0], True, False, 17, ["Conv", "Clip"]),  # bounds as inputs from opset 11
        ("Clip", [-1.0, 1.0], True, True, 9, ["Conv", "Add", "Clip"]),  # bounds as attributes before
        ("LeakyRelu", [0.1], True, False, 17, ["Conv", "LeakyRelu"]),
        ("HardSigmoid", [0.3, 0.4], True, False, 17, ["Conv", "HardSigmoid"]),
    ],
)
def test_unfuse_convs_is_exact(
    activation: str | None, params: list[float], bias: bool, residual: bool, opset: int, written: list[str]
) -> None:
    import numpy as np
    from fusion_helpers import run

    from passes.quantize.modes import unfuse_convs

    fused = fused_conv_graph(activation, params, bias, residual, opset)
    rng = np.random.default_rng(1)
    feed = {n.name: rng.normal(size=(1, 4, 6, 6)).astype(np.float32) for n in fused.graph.input}
    plain = onnx.ModelProto()
    plain.CopyFrom(fused)
    unfused = unfuse_convs(plain, ["Conv"])
    onnx.checker.check_model(plain)
    assert [n.op_type for n in plain.graph.node] == written and unfused.convs == ["conv_Fused"]
    assert plain.graph.node[0].name == "conv_Fused"  # exclude_nodes naming the fused node still reaches its Conv
    (y_fused,), (y_plain,) = run(fused, feed), run(plain, feed)
    assert np.abs(y_fused).max() > 0.5 and np.abs(y_fused - y_plain).max() < 1e-5
    # The static quantizer is told to quantize the Add and the activations with INT8 kernels, nothing else.
    assert unfused.extra_ops == sorted({"Add", "Relu", "Clip", "LeakyRelu"} & set(written))


def test_unfuse_convs_keeps_what_it_cannot_write_back() -> None:
    from passes.quantize.modes import unfuse_convs

    model = fused_conv_graph("LeakyRelu", [], True, False, 17)  # LeakyRelu without its alpha: not guessed
    assert unfuse_convs(model, ["Conv"]).kept == ["conv_Fused"]
    assert [n.op_type for n in model.graph.node] == ["FusedConv"]
    model = fused_conv_graph("Relu", [], True, False, 17)
    assert unfuse_convs(model, ["MatMul"]).convs == [] and model.graph.node[0].op_type == "FusedConv"


def test_unfuse_convs_asks_int8_only_for_its_own_followers() -> None:
    """The Add/Relu written back from a FusedConv are quantized with it; a Relu the user did not list is not."""
    from onnx import helper

    from passes.quantize.modes import unfuse_convs

    model = fused_conv_graph("Relu", [], True, False, 17)
    model.graph.node.append(helper.make_node("Relu", ["y"], ["y2"], name="head_relu"))
    model.graph.output[0].name = "y2"
    unfused = unfuse_convs(model, ["Conv", "MatMul"])
    assert unfused.extra_ops == ["Relu"] and unfused.extra_exclude == ["head_relu"]
    assert unfuse_convs(fused_conv_graph("Relu", [], True, False, 17), ["Conv", "Relu"]).extra_ops == []


def test_int8_weights_are_7_bit_on_x86_without_vnni() -> None:
    """ORT's u8s8 kernels saturate on x86 without VNNI (AVX2): there, and only there, weights go to 7 bits."""
    from optimizer.runtime.cpu_features import int8_reduce_range

    avx2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
    assert int8_reduce_range(avx2, "x86_64")[0] is True
    assert int8_reduce_range(avx2 | {"avx512f", "avx512_vnni"}, "x86_64") == (
        False, "this CPU has avx512_vnni: full-range INT8 weights")
    assert int8_reduce_range(avx2 | {"avx_vnni"}, "x86_64")[0] is False
    assert int8_reduce_range(frozenset(), "x86_64")[0] is False  # flags unknown: as ORT's default
    assert int8_reduce_range(frozenset({"asimd"}), "aarch64")[0] is False
