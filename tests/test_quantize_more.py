"""More of a transformer in INT8 on the CPU: smoothing (exact in FP32, less INT8 error on an outlier channel), the
INT8 attention core (the integer op types it yields), and the hybrid's techniques, each a line with its numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import FAST_BENCH, write_recipe
from onnx import TensorProto, helper, numpy_helper

from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import load_recipe
from passes.quantize import attention, modes, smooth

MS = "com.microsoft"


def bert_block(hidden: int = 32, heads: int = 4, ffn: int = 64, outlier: float = 1.0, seed: int = 0) -> Any:
    """One post-LN BERT layer as the CPU fusion writes it: LayerNorm -> Attention -> Reshape -> MatMul ->
    SkipLayerNorm -> MatMul -> Gelu -> MatMul -> SkipLayerNorm. `outlier` scales channel 3 of the first two
    LayerNorms and FFN channel 5: the outlier channels of real BERT activations."""
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.1) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    gamma = np.ones(hidden, np.float32)
    gamma[3] = outlier
    w1 = w(hidden, ffn)
    w1[:, 5] *= outlier
    inits = {
        "g0": gamma, "b0": w(hidden), "qkv_w": w(hidden, 3 * hidden), "qkv_b": w(3 * hidden),
        "shape": np.array([0, 0, hidden], np.int64), "wo": w(hidden, hidden), "g1": gamma.copy(),
        "b1": w(hidden), "w1": w1, "bias1": w(ffn), "w2": w(ffn, hidden), "g2": np.ones(hidden, np.float32),
        "b2": w(hidden),
    }  # fmt: skip
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g0", "b0"], ["ln0"], axis=-1, name="ln0"),
        helper.make_node("Attention", ["ln0", "qkv_w", "qkv_b", "mask"], ["att"], domain=MS, num_heads=heads,
                         name="attn"),
        helper.make_node("Reshape", ["att", "shape"], ["att_r"], name="att_reshape"),
        helper.make_node("MatMul", ["att_r", "wo"], ["o"], name="attn_out"),
        helper.make_node("SkipLayerNormalization", ["o", "ln0", "g1", "b1"], ["ln1"], domain=MS, name="ln1"),
        helper.make_node("MatMul", ["ln1", "w1"], ["h"], name="ffn_in"),
        helper.make_node("Add", ["h", "bias1"], ["hb"], name="ffn_bias"),
        helper.make_node("Gelu", ["hb"], ["act"], domain=MS, name="gelu"),
        helper.make_node("MatMul", ["act", "w2"], ["f"], name="ffn_out"),
        helper.make_node("SkipLayerNormalization", ["f", "ln1", "g2", "b2"], ["y"], domain=MS, name="ln2"),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "bert_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", hidden]),
         helper.make_tensor_value_info("mask", TensorProto.INT32, [1, "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq", hidden])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )  # fmt: skip
    # Types for the contrib ops' outputs, which ONNX's shape inference cannot give (the fuse pass writes them too).
    graph.value_info.extend(
        helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for n in nodes for o in n.output if o != "y"
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)])
    model.ir_version = 8
    return model


def feeds(n: int = 6, seq: int = 16, hidden: int = 32, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        mask = np.ones((1, seq), np.int32)
        mask[0, seq - 1 - i :] = 0  # right padding, as a tokenizer writes it
        out.append({"x": rng.standard_normal((1, seq, hidden)).astype(np.float32), "mask": mask})
    return out


def run(model: Any, inputs: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return [session.run(names, f) for f in inputs]


def outputs(model: Any, inputs: list[dict[str, np.ndarray]]) -> np.ndarray:
    return np.stack([r[0] for r in run(model, inputs)])


def smoothed(model: Any, nodes: list[str], alpha: float, calib: list[dict[str, np.ndarray]]) -> tuple[Any, list]:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    found = smooth.groups(out, nodes)
    absmax = smooth.activation_absmax(out, [g.tensor for g in found], lambda probe: run(probe, calib))
    return out, smooth.apply(out, absmax, found, alpha)


def int8(model: Any, tmp_path: Path, name: str, **kw: Any) -> Any:
    src, dst = tmp_path / f"{name}_in.onnx", tmp_path / f"{name}.onnx"
    onnx.save(model, src)
    modes.int8_dynamic(src, dst, True, kw.pop("ops", ["MatMul", "Attention"]), kw.pop("nodes", None), [], **kw)
    return onnx.load(dst)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


# ------------------------------------------------------------------ smoothing
def test_smoothing_is_exact_in_fp32_and_folds_where_it_can() -> None:
    model = bert_block(outlier=20.0)
    calib, test = feeds(seed=1), feeds(seed=2)
    every = ["attn", "attn_out", "ffn_in", "ffn_out"]
    out, records = smoothed(model, every, 0.7, calib)
    where = {r["nodes"][0]: r["folded_into"] for r in records}
    # The attention output's scale goes into V (through the Reshape), LayerNorm outputs that are also the
    # residual and the GELU output get a Mul.
    assert where["attn_out"] == "attn"
    assert where["ffn_in"].startswith("ffn_in_smooth") and where["ffn_out"].startswith("ffn_out_smooth")
    assert where["attn"].startswith("attn_smooth")
    assert sum(n.op_type == "Mul" for n in out.graph.node) == 3
    ref, got = outputs(model, test), outputs(out, test)
    assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()  # a rescaling: FP32 outputs unchanged
    ffn_in = next(r for r in records if r["nodes"] == ["ffn_in"])
    assert ffn_in["outlier_ratio_before"] > 10 and ffn_in["outlier_ratio_after"] < ffn_in["outlier_ratio_before"] / 3


def test_smoothing_folds_into_a_layernorm_read_only_by_the_matmul() -> None:
    model = bert_block(outlier=20.0)
    # Make ln1 feed only ffn_in: the second SkipLayerNorm takes the attention output as its residual instead.
    next(n for n in model.graph.node if n.name == "ln2").input[1] = "o"
    out, records = smoothed(model, ["ffn_in"], 0.5, feeds(seed=1))
    assert records[0]["folded_into"] == "ln1" and not any(n.op_type == "Mul" for n in out.graph.node)
    test = feeds(seed=2)
    ref, got = outputs(model, test), outputs(out, test)
    assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()


def test_smoothing_lowers_the_int8_error_of_an_outlier_channel_layer(tmp_path: Path) -> None:
    model = bert_block(outlier=30.0)
    calib, test = feeds(seed=1), feeds(seed=2)
    ref = outputs(model, test)
    plain = rel_err(outputs(int8(model, tmp_path, "plain", nodes=["ffn_in"]), test), ref)
    out, _ = smoothed(model, ["ffn_in"], 0.7, calib)
    smooth_err = rel_err(outputs(int8(out, tmp_path, "smooth", nodes=["ffn_in"]), test), ref)
    assert plain > 0.01  # the outlier channel sets the per-tensor scale: the other channels lose their bits
    assert smooth_err < 0.5 * plain, (plain, smooth_err)


def test_scales_follow_the_formula() -> None:
    s = smooth.scales(np.array([4.0, 1.0, 0.0]), np.array([1.0, 4.0, 1.0]), 0.5)
    assert np.allclose(s, [2.0, 0.5, 1.0])  # sqrt(4 / 1), sqrt(1 / 4), a dead channel keeps 1


# ------------------------------------------------------------------ INT8 attention core
def test_attention_unfused_is_exact_and_its_core_quantized(tmp_path: Path) -> None:
    model = bert_block()
    test = feeds(seed=2)
    ref = outputs(model, test)
    plain = onnx.ModelProto()
    plain.CopyFrom(model)
    unfused = attention.unfuse(plain)
    assert unfused.core == {"attn": ["attn_qk", "attn_pv"]} and not unfused.kept
    assert not any(n.op_type == "Attention" for n in plain.graph.node)
    assert np.abs(outputs(plain, test) - ref).max() < 1e-4 * np.abs(ref).max()
    # Default dynamic INT8 of the fused graph: QAttention (projection in INT8, core in FP32).
    fused_q = int8(model, tmp_path, "fused")
    assert sum(n.op_type == "QAttention" for n in fused_q.graph.node) == 1
    # The core too: 4 weight MatMuls and QK^T and x V, each through an integer MatMul, both core inputs quantized.
    nodes = modes.quantizable_nodes(plain, ["MatMul"]) + unfused.core_nodes()
    core_q = int8(plain, tmp_path, "core", ops=["MatMul"], nodes=nodes, const_b_only=False)
    ops = [n.op_type for n in core_q.graph.node]
    assert ops.count("MatMulInteger") == 6 and "QAttention" not in ops
    assert ops.count("DynamicQuantizeLinear") == 4 + 2 * 2  # one per weight MatMul input, two per core MatMul
    assert rel_err(outputs(core_q, test), ref) < 0.1


def test_attention_with_past_state_stays_fused() -> None:
    model = bert_block()
    node = next(n for n in model.graph.node if n.op_type == "Attention")
    node.attribute.append(helper.make_attribute("unidirectional", 1))
    unfused = attention.unfuse(model)
    assert unfused.core == {} and "causal" in unfused.kept["attn"]


# ------------------------------------------------------------------ in the pipeline: stages and attribution
TINY_BERT = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
             "vocab_size": 200}  # fmt: skip
BERT_INPUTS = [
    {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, 200]},
    {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"], "fill": "ones"},
]


def compile_bert(tmp_path: Path, passes: list[dict[str, Any]]) -> dict[str, Any]:
    data = {
        "name": "quantize-more",
        "model": {"source": "hf_config", "architecture": "bert", "config": TINY_BERT},
        "inputs": BERT_INPUTS,
        "outputs": ["last_hidden_state"],
        "scenarios": [{"name": "b1-s32", "batch": 1, "seq": 32}],
        "target": {"threads": 1},
        "benchmark": FAST_BENCH,
        "accuracy": {"samples": 2},
        "passes": [{"type": "export"}, {"type": "fuse"}, *passes],
    }
    records = Pipeline(load_recipe(write_recipe(tmp_path, data)), tmp_path / "out", measure=False).execute()
    assert all(r.ok for r in records), [(r.name, r.reason) for r in records]
    return {r.name: r for r in records}


@pytest.mark.slow
def test_stages_and_hybrid_techniques_attributed(tmp_path: Path) -> None:
    stages = compile_bert(
        tmp_path,
        [
            {"type": "quantize", "name": "int8_core", "from": "fuse",
             "config": {"mode": "int8_dynamic", "attention_core": "int8", "smooth": {"alpha": 0.7},
                        "calibration": {"samples": 4}}},
            {"type": "quantize", "name": "hybrid_forms", "from": "fuse",
             "config": {"mode": "hybrid", "calibration": {"samples": 4},
                        "hybrid": {"min_cosine": 0.5, "margin": 0.0, "candidates": ["static", "attention_core"]}}},
            {"type": "quantize", "name": "hybrid_smooth", "from": "fuse",
             "config": {"mode": "hybrid", "calibration": {"samples": 4}, "smooth": {"alpha": 0.7},
                        "hybrid": {"min_cosine": 0.99999999, "margin": 0.0, "choose": "most_int8"}}},
        ],
    )  # fmt: skip
    core = stages["int8_core"]
    assert len(core.notes["attention_core_int8"]) == 2  # both layers' attention written back, core in INT8
    assert len(core.notes["smooth"]["groups"]) >= 4 and core.notes["quantization_ops"]["MatMulInteger"] >= 2 * 6
    assert "QAttention" not in core.notes["quantization_ops"]

    forms = json.loads((stages["hybrid_forms"].artifact.path.parent / "hybrid_search.json").read_text())
    lines = {t["technique"]: t for t in forms["techniques"]}
    assert set(lines) == {"static", "attention_core"}
    chosen = len(stages["hybrid_forms"].notes["int8_nodes"])
    for line in lines.values():  # within a 0.5 budget both are timed head to head with the set they were tried on
        versus = line["vs_previous"]
        assert 0.5 <= line["cosine"] <= 1.0 + 1e-9 and 0 < versus["low"] <= versus["ratio"] <= versus["high"]
        assert versus["p50_ms"] > 0 and versus["input_p50_ms"] > 0  # both timings: the form's and the previous one's
        assert line["kept"] == (versus["low"] > 1.0) and line["gain"] == versus["ratio"] and line["why"]
        assert line["int8_nodes"] == line["previous"]["int8_nodes"] == chosen
    # Static is tried against the dynamic set the search chose.
    assert lines["static"]["previous"]["form"] == "dynamic" and lines["static"]["calibration"]["samples"] >= 1
    kept = [t["technique"] for t in forms["techniques"] if t["kept"]]
    assert forms["form"] == (kept[-1] if kept else "dynamic")
    assert stages["hybrid_forms"].notes["form"] == forms["form"]

    tight = json.loads((stages["hybrid_smooth"].artifact.path.parent / "hybrid_search.json").read_text())
    line = next(t for t in tight["techniques"] if t["technique"] == "smooth")
    held = [n for n in stages["hybrid_smooth"].notes["fp32_nodes"]]
    assert isinstance(line["kept"], bool) and line["why"]
    # The tight budget holds nodes in FP32: every node is smoothed, the held ones tried in INT8 again.
    assert line["held_in_fp32_before"] and set(line["smoothed_nodes"]) >= set(line["held_in_fp32_before"])
    assert line["groups"] and 0 < line["cosine"] <= 1.0 + 1e-9 and line["alpha"] == 0.7
    assert set(held) <= set(line["held_in_fp32_before"])


def test_options_of_another_mode_are_refused_in_one_line(tmp_path: Path) -> None:
    from conftest import mlp_recipe

    from optimizer.core.errors import RecipeError

    data = mlp_recipe(passes=[{"type": "export"}, {"type": "quantize", "config": {"mode": "fp16", "smooth": {}}}])
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(tmp_path, data))
    assert "passes[1].config" in str(err.value) and "smooth applies to int8_dynamic" in str(err.value)
