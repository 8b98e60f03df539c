"""Each fusion rule on a tiny graph built here: what it fuses, what it declines (and why), and that the
outputs do not change."""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
from collections import Counter

import numpy as np
import onnx
import pytest
from fusion_helpers import assert_same, float_input, fuse, model, ops
from onnx import helper

from passes.fuse import FUSED_OPS, RULE_NAMES, RULES, count_fused, valid_ir_version
from passes.fuse.attention import Decline, classify_mask

rng = np.random.default_rng(0)


def layernorm_graph(eps: float = 1e-5) -> tuple:
    h = 8
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["mean"], axes=[-1]),
        helper.make_node("Sub", ["x", "mean"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["var"], axes=[-1]),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["std"]),
        helper.make_node("Div", ["d", "std"], ["norm"]),
        helper.make_node("Mul", ["norm", "gamma"], ["scaled"]),
        helper.make_node("Add", ["scaled", "beta"], ["y"]),
    ]
    inits = {
        "two": np.float32(2.0),
        "eps": np.float32(eps),
        "gamma": rng.normal(size=h).astype(np.float32),
        "beta": rng.normal(size=h).astype(np.float32),
    }
    m = model(nodes, [float_input("x", [2, 3, h])], ["y"], inits)
    return m, {"x": rng.normal(size=(2, 3, h)).astype(np.float32)}


def test_layernorm_from_decomposed_form() -> None:
    m, feed = layernorm_graph()
    out, reports = fuse(m, feed, ["layernorm"], target="tensorrt")
    assert reports["layernorm"].fused == 1
    assert ops(out) == {"LayerNormalization": 1}
    assert_same(m, out, feed)


def skip_graph(reuse_sum: bool, bias: bool) -> tuple:
    h = 8
    nodes = [helper.make_node("MatMul", ["a", "w"], ["mm"])]
    first = "mm"
    if bias:
        nodes.append(helper.make_node("Add", ["mm", "b"], ["mmb"]))
        first = "mmb"
    nodes += [
        helper.make_node("Add", [first, "skip"], ["sum"]),
        helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1, epsilon=1e-5),
    ]
    outputs = ["y"]
    if reuse_sum:
        nodes.append(helper.make_node("Mul", ["sum", "y"], ["z"]))
        outputs = ["z"]
    inits = {
        "w": rng.normal(size=(h, h)).astype(np.float32),
        "b": rng.normal(size=h).astype(np.float32),
        "gamma": rng.normal(size=h).astype(np.float32),
        "beta": rng.normal(size=h).astype(np.float32),
    }
    m = model(nodes, [float_input("a", [2, 3, h]), float_input("skip", [2, 3, h])], outputs, inits)
    feed = {"a": rng.normal(size=(2, 3, h)).astype(np.float32), "skip": rng.normal(size=(2, 3, h)).astype(np.float32)}
    return m, feed


@pytest.mark.parametrize("reuse_sum", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_skip_layernorm(reuse_sum: bool, bias: bool) -> None:
    m, feed = skip_graph(reuse_sum, bias)
    out, reports = fuse(m, feed, ["skip_layernorm"])
    assert reports["skip_layernorm"].fused == 1
    assert ops(out)["SkipLayerNormalization"] == 1 and "LayerNormalization" not in ops(out)
    assert ops(out)["Add"] == 0  # the bias and the residual sum both went into the op
    assert_same(m, out, feed)


def test_skip_layernorm_declines_broadcast_and_tensorrt() -> None:
    h = 8
    nodes = [
        helper.make_node("Add", ["a", "pos"], ["sum"]),
        helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], axis=-1),
    ]
    inits = {"gamma": np.ones(h, np.float32), "beta": np.zeros(h, np.float32)}
    m = model(nodes, [float_input("a", [2, 3, h]), float_input("pos", [1, 3, h])], ["y"], inits)
    feed = {"a": rng.normal(size=(2, 3, h)).astype(np.float32), "pos": rng.normal(size=(1, 3, h)).astype(np.float32)}
    _, reports = fuse(m, feed, ["skip_layernorm"])
    assert reports["skip_layernorm"].fused == 0
    assert "not two same-shape 3-D tensors" in reports["skip_layernorm"].misses[0]
    m2, feed2 = skip_graph(False, False)
    out, reports = fuse(m2, feed2, ["skip_layernorm"], target="tensorrt")
    assert reports["skip_layernorm"].fused == 0 and ops(out)["LayerNormalization"] == 1


def gelu_erf_graph(order: str, bias: bool) -> tuple:
    h = 8
    nodes = []
    x = "x"
    if bias:
        nodes.append(helper.make_node("Add", ["x", "b"], ["xb"]))
        x = "xb"
    nodes += [
        helper.make_node("Div", [x, "sqrt2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["p"]),
    ]
    if order == "half_first":
        nodes += [helper.make_node("Mul", [x, "half"], ["xh"]), helper.make_node("Mul", ["xh", "p"], ["y"])]
    elif order == "x_first":
        nodes += [helper.make_node("Mul", [x, "p"], ["xp"]), helper.make_node("Mul", ["xp", "half"], ["y"])]
    else:
        nodes += [helper.make_node("Mul", ["p", "half"], ["ph"]), helper.make_node("Mul", ["ph", x], ["y"])]
    inits = {
        "sqrt2": np.float32(math.sqrt(2)),
        "one": np.float32(1),
        "half": np.float32(0.5),
        "b": rng.normal(size=h).astype(np.float32),
    }
    m = model(nodes, [float_input("x", [2, 3, h])], ["y"], inits)
    return m, {"x": rng.normal(size=(2, 3, h)).astype(np.float32) * 3}


@pytest.mark.parametrize("order", ["half_first", "x_first", "half_last"])
def test_gelu_erf_forms(order: str) -> None:
    m, feed = gelu_erf_graph(order, bias=False)
    out, reports = fuse(m, feed, ["gelu"])
    assert reports["gelu"].fused == 1 and ops(out) == {"Gelu": 1}
    assert out.graph.node[0].domain == "com.microsoft"
    assert_same(m, out, feed)


def test_bias_gelu() -> None:
    m, feed = gelu_erf_graph("half_first", bias=True)
    out, reports = fuse(m, feed, ["gelu", "bias_gelu"])
    assert reports["bias_gelu"].fused == 1 and ops(out) == {"BiasGelu": 1}
    assert_same(m, out, feed)


def test_gelu_for_tensorrt_is_the_standard_op_at_opset_20() -> None:
    m, feed = gelu_erf_graph("x_first", bias=False)
    m.opset_import[0].version = 20
    out, reports = fuse(m, feed, ["gelu", "bias_gelu"], target="tensorrt")
    assert ops(out) == {"Gelu": 1} and out.graph.node[0].domain in ("", "ai.onnx")
    assert reports["bias_gelu"].skipped == "bias-gelu: not used for target tensorrt"
    assert reports["bias_gelu"].to_json()["not_fused"] == ["bias-gelu: not used for target tensorrt"]
    assert_same(m, out, feed)


def test_gelu_tanh_form_to_fastgelu() -> None:
    h = 8
    nodes = [
        helper.make_node("Pow", ["x", "three"], ["x3"]),
        helper.make_node("Mul", ["x3", "c1"], ["cx3"]),
        helper.make_node("Add", ["x", "cx3"], ["inner"]),
        helper.make_node("Mul", ["inner", "c2"], ["scaled"]),
        helper.make_node("Tanh", ["scaled"], ["t"]),
        helper.make_node("Add", ["t", "one"], ["p"]),
        helper.make_node("Mul", ["x", "half"], ["xh"]),
        helper.make_node("Mul", ["xh", "p"], ["y"]),
    ]
    inits = {
        "three": np.float32(3),
        "c1": np.float32(0.044715),
        "c2": np.float32(math.sqrt(2 / math.pi)),
        "one": np.float32(1),
        "half": np.float32(0.5),
    }
    m = model(nodes, [float_input("x", [2, h])], ["y"], inits)
    feed = {"x": rng.normal(size=(2, h)).astype(np.float32) * 3}
    out, reports = fuse(m, feed, ["gelu"])
    assert reports["gelu"].fused == 1 and ops(out) == {"FastGelu": 1}
    assert_same(m, out, feed)


def gemm_graph() -> tuple:
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["y"]),
        helper.make_node("MatMul", ["x3", "w"], ["mm3"]),
        helper.make_node("Add", ["mm3", "b"], ["y3"]),
    ]
    inits = {"w": rng.normal(size=(8, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}
    m = model(nodes, [float_input("x", [5, 8]), float_input("x3", [2, 5, 8])], ["y", "y3"], inits)
    feed = {"x": rng.normal(size=(5, 8)).astype(np.float32), "x3": rng.normal(size=(2, 5, 8)).astype(np.float32)}
    return m, feed


def test_gemm_only_for_2d_inputs() -> None:
    m, feed = gemm_graph()
    out, reports = fuse(m, feed, ["gemm"])
    assert reports["gemm"].fused == 1 and ops(out)["Gemm"] == 1 and ops(out)["MatMul"] == 1
    assert "input is 3-D" in reports["gemm"].misses[0]
    assert_same(m, out, feed)


def conv_graph() -> tuple:
    c = 4
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "g", "be", "mu", "var"], ["bn"], epsilon=1e-3),
        helper.make_node("Relu", ["bn"], ["r"]),
        helper.make_node("Conv", ["r", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "x"], ["s"]),
        helper.make_node("Relu", ["s"], ["y"]),
    ]
    inits = {
        "w": rng.normal(size=(c, c, 3, 3)).astype(np.float32),
        "g": rng.uniform(0.5, 1.5, c).astype(np.float32),
        "be": rng.normal(size=c).astype(np.float32),
        "mu": rng.normal(size=c).astype(np.float32),
        "var": rng.uniform(0.5, 2, c).astype(np.float32),
        "w2": rng.normal(size=(c, c, 3, 3)).astype(np.float32),
        "b2": rng.normal(size=c).astype(np.float32),
    }
    m = model(nodes, [float_input("x", [1, c, 6, 6])], ["y"], inits)
    return m, {"x": rng.normal(size=(1, c, 6, 6)).astype(np.float32)}


def test_conv_bn_folding_is_exact() -> None:
    m, feed = conv_graph()
    out, reports = fuse(m, feed, ["conv_bn"], target="tensorrt")
    assert reports["conv_bn"].fused == 1 and "BatchNormalization" not in ops(out)
    assert_same(m, out, feed, atol=1e-4)


def test_conv_relu_and_conv_add_relu_to_fusedconv_on_cpu_only() -> None:
    m, feed = conv_graph()
    out, reports = fuse(m, feed, ["conv_bn", "conv_activation"])
    assert reports["conv_activation"].fused == 2
    assert ops(out) == {"FusedConv": 2}
    assert_same(m, out, feed, atol=1e-4)
    _, reports = fuse(m, feed, ["conv_bn", "conv_activation"], target="cuda")
    assert reports["conv_activation"].fused == 0 and "CPU kernel" in (reports["conv_activation"].skipped or "")


def test_fused_ir3_graph_is_written_at_ir4() -> None:
    """IR 3 (old exporters): every initializer is also a graph input. The fused graph keeps its weights as
    initializers only, which is valid from IR 4 on; an IR version that needs no change is kept."""
    m, feed = conv_graph()
    m.ir_version = 3
    for init in m.graph.initializer:
        m.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    onnx.checker.check_model(m)
    out, _ = fuse(m, feed, ["conv_bn", "conv_activation"])
    assert out.ir_version == 3 and [i.name for i in out.graph.input] == ["x"]
    with pytest.raises(onnx.checker.ValidationError, match="not in graph input"):
        onnx.checker.check_model(out)
    assert valid_ir_version(out) == 4
    onnx.checker.check_model(out)
    assert_same(m, out, feed, atol=1e-4)
    current, _ = conv_graph()
    assert valid_ir_version(current) == current.ir_version >= 4


NEG = np.float32(-3.4e38)


def test_mask_classification() -> None:
    s = 4
    pad = np.array([[1, 1, 1, 1], [1, 1, 0, 0]])
    padding = np.where(pad[:, None, None, :] == 1, 0, NEG).astype(np.float32)
    causal = np.where(np.tril(np.ones((s, s)))[None, None] == 1, 0, -np.inf).astype(np.float32)
    assert classify_mask(np.zeros((2, 1, s, s), np.float32), pad, s) == "none"
    assert classify_mask(padding, pad, s) == "padding"
    assert classify_mask(causal, pad, s) == "causal"
    assert classify_mask(np.minimum(padding, causal), pad, s) == "causal+padding"
    with pytest.raises(Decline, match="a bias, not a mask"):
        classify_mask(rng.normal(size=(2, 1, s, s)).astype(np.float32), pad, s)
    with pytest.raises(Decline, match="3-D"):
        classify_mask(np.zeros((2, s, s), np.float32), pad, s)
    sliding = np.where(np.abs(np.arange(s)[:, None] - np.arange(s)[None]) <= 1, 0, NEG)[None, None].astype(np.float32)
    with pytest.raises(Decline, match="not a 2-D padding mask"):
        classify_mask(sliding, pad, s)


def test_gelu_declined_for_tensorrt_below_opset_20_keeps_the_graph() -> None:
    m, feed = gelu_erf_graph("x_first", bias=False)  # opset 17: TensorRT has no Gelu op to fuse into
    out, reports = fuse(m, feed, ["gelu"], target="tensorrt")
    assert reports["gelu"].fused == 0 and "opset 17 < 20 has no Gelu" in reports["gelu"].misses[0]
    assert ops(out)["Erf"] == 1
    assert_same(m, out, feed)


def test_fused_ops_are_derived_from_the_rules_emits() -> None:
    assert set(FUSED_OPS) == {op for rule in RULES for op in rule.emits}
    assert {"Attention", "SkipLayerNormalization", "LayerNormalization", "BiasGelu", "Gelu", "FastGelu"} <= set(
        FUSED_OPS
    )
    before = Counter({"MatMul": 2, "Add": 2, "LayerNormalization": 1})
    after = Counter({"MatMul": 1, "Gemm": 1, "LayerNormalization": 1, "Cast": 1})
    # Only declared op types count, and only where the graph gained some.
    assert count_fused(before, after) == {"Gemm": 1}


def test_every_rule_resolves_to_its_rewrite() -> None:
    assert tuple(r.name for r in RULES) == RULE_NAMES and len(set(RULE_NAMES)) == len(RULES)
    for rule in RULES:
        module, func = rule.impl.split(":")
        assert callable(getattr(importlib.import_module(module), func)), rule.name
        assert rule.targets and rule.targets <= {"cpu", "cuda", "tensorrt"}, rule.name


def test_rules_off_target_are_not_run_and_say_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def must_not_run(*args: object) -> None:
        raise AssertionError("an off-target rule ran")

    monkeypatch.setattr("passes.fuse.conv.fuse_conv_activation", must_not_run)
    monkeypatch.setattr("passes.fuse.attention_rule.fuse_attention", must_not_run)
    m, feed = conv_graph()
    out, reports = fuse(m, feed, ["conv_bn", "attention", "conv_activation"], target="tensorrt")
    assert reports["conv_bn"].fused == 1 and reports["conv_bn"].skipped is None
    assert reports["attention"].skipped == "attention: com.microsoft.Attention is not available for target tensorrt"
    assert reports["conv_activation"].skipped == (
        "conv-activation: FusedConv is a CPU kernel; target tensorrt fuses this itself"
    )
    assert reports["conv_activation"].to_json() == {
        "fused": 0,
        "not_fused": [reports["conv_activation"].skipped],
        "matched": 0,
        "skipped": reports["conv_activation"].skipped,
    }
    assert "FusedConv" not in ops(out)
    assert [r.name for r in RULES if not r.runs_on("tensorrt")] == [
        "attention",
        "skip_layernorm",
        "bias_gelu",
        "kv_attention",
        "conv_activation",
    ]


def test_rule_report_says_what_matched_fused_and_declined() -> None:
    m, feed = gemm_graph()
    _, reports = fuse(m, feed, ["gemm"])
    report = reports["gemm"].to_json()
    assert report["fused"] == 1 and report["matched"] == 2
    assert report["not_fused"] == ["gemm at MatMul_2: input is 3-D, Gemm pays only for 2-D"]
    assert "skipped" not in report and "details" not in report


def test_rule_declarations_load_without_graphsurgeon() -> None:
    """Recipe validation imports passes.fuse for its config; the rewrites (and onnx-graphsurgeon) wait for a run."""
    code = "import sys, passes.fuse; sys.exit('onnx_graphsurgeon' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
