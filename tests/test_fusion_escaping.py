"""Fusion rules and intermediates that escape their match (issue 30).

A rewrite replaces the matched nodes by one fused op that keeps only the match's inputs and final outputs. When
an intermediate of the match is also a graph output or feeds a node outside it, the original nodes must stay
to compute it: the work would be done twice and still counted as a fusion. Every rule declines such a match,
with the reason naming the tensor, and leaves the graph as it was; an optional tail of a pattern (LayerNorm's
gamma and beta, SkipLayerNorm's bias, FusedConv's Relu after the Add) is left out of the match instead. Each
case has its control: the same graph without the escape fuses.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import onnx
import pytest
from fusion_helpers import assert_same, float_input, fuse, model, ops
from onnx import TensorProto, helper
from test_fusion_rules import conv_graph, gelu_erf_graph, gemm_graph, layernorm_graph, skip_graph

rng = np.random.default_rng(30)

USER = "user"  # the node outside the match that also reads the intermediate


def escaping(m: Any, tensor: str, how: str) -> Any:
    """A copy of `m` where `tensor` is also a graph output (how="output") or also read by a node outside the
    pattern (how="node": Neg named `user`, whose output becomes a graph output)."""
    out = onnx.ModelProto()
    out.CopyFrom(m)
    if how == "output":
        out.graph.output.append(helper.make_tensor_value_info(tensor, TensorProto.FLOAT, None))
    else:
        out.graph.node.append(helper.make_node("Neg", [tensor], [f"{tensor}_negated"], name=USER))
        out.graph.output.append(helper.make_tensor_value_info(f"{tensor}_negated", TensorProto.FLOAT, None))
    return out


def reason(place: str, tensor: str, how: str) -> str:
    used = "a graph output" if how == "output" else f"used by {USER}"
    return f"{place}: intermediate {tensor} is also {used}"


def declined(m: Any, feed: dict[str, np.ndarray], rules: list[str], place: str, tensor: str, how: str) -> Any:
    """Run `rules`; the last one must decline at `place` naming `tensor`, and the graph must compute the same."""
    out, reports = fuse(m, feed, rules)
    report = reports[rules[-1]]
    assert report.fused == 0, report.to_json()
    assert report.misses == [reason(place, tensor, how)], report.misses
    assert_same(m, out, feed, atol=1e-4)
    return out


HOWS = ["output", "node"]


# LayerNorm: ReduceMean_0 Sub_1 Pow_2 ReduceMean_3 Add_4 Sqrt_5 Div_6 (Mul_7 Add_8: gamma, beta)


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("tensor", ["mean", "d", "sq", "var", "ve", "std"])
def test_layernorm_declines_an_escaping_intermediate(tensor: str, how: str) -> None:
    m, feed = layernorm_graph()
    out = declined(escaping(m, tensor, how), feed, ["layernorm"], "layernorm at Div_6", tensor, how)
    assert "LayerNormalization" not in ops(out) and ops(out)["Sqrt"] == 1


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize(("tensor", "left"), [("norm", {"Mul": 1, "Add": 1}), ("scaled", {"Add": 1})])
def test_layernorm_leaves_an_escaping_gamma_or_beta_step_outside(tensor: str, left: dict[str, int], how: str) -> None:
    """gamma and beta are optional steps of the pattern: where the tensor before one escapes, LayerNorm stops there
    and the Mul / Add stay, each computed once."""
    m, feed = layernorm_graph()
    m2 = escaping(m, tensor, how)
    out, reports = fuse(m2, feed, ["layernorm"])
    assert reports["layernorm"].fused == 1 and not reports["layernorm"].misses
    assert ops(out) == Counter({"LayerNormalization": 1, **left, **({"Neg": 1} if how == "node" else {})})
    assert_same(m2, out, feed)


def test_layernorm_control_fuses() -> None:
    m, feed = layernorm_graph()
    out, reports = fuse(m, feed, ["layernorm"])
    assert reports["layernorm"].fused == 1 and ops(out) == {"LayerNormalization": 1}
    assert_same(m, out, feed)


# SkipLayerNorm: MatMul_0 Add_1 (bias) Add_2 (skip) LayerNormalization_3


@pytest.mark.parametrize("how", HOWS)
def test_skip_layernorm_leaves_an_escaping_bias_add_outside(how: str) -> None:
    """The bias Add is an optional step: when its output escapes, SkipLayerNorm takes that output as its input
    instead of folding the bias in (which would add the bias twice: once in the op, once in the Add kept)."""
    m, feed = skip_graph(reuse_sum=False, bias=True)
    m2 = escaping(m, "mmb", how)
    out, reports = fuse(m2, feed, ["skip_layernorm"])
    assert reports["skip_layernorm"].fused == 1 and not reports["skip_layernorm"].misses
    skip = next(n for n in out.graph.node if n.op_type == "SkipLayerNormalization")
    assert list(skip.input) == ["mmb", "skip", "gamma", "beta"]
    assert ops(out)["Add"] == 1 and "LayerNormalization" not in ops(out)
    assert_same(m2, out, feed)


@pytest.mark.parametrize("how", HOWS)
def test_skip_layernorm_keeps_an_escaping_sum_as_its_output(how: str) -> None:
    """The residual sum is an output SkipLayerNormalization can return: it is kept, not an escape."""
    m, feed = skip_graph(reuse_sum=False, bias=True)
    m2 = escaping(m, "sum", how)
    out, reports = fuse(m2, feed, ["skip_layernorm"])
    assert reports["skip_layernorm"].fused == 1 and ops(out)["Add"] == 0
    skip = next(n for n in out.graph.node if n.op_type == "SkipLayerNormalization")
    assert skip.output[3] == "sum"
    assert_same(m2, out, feed)


def test_skip_layernorm_control_fuses() -> None:
    m, feed = skip_graph(reuse_sum=False, bias=True)
    out, reports = fuse(m, feed, ["skip_layernorm"])
    assert reports["skip_layernorm"].fused == 1 and ops(out) == {"SkipLayerNormalization": 1, "MatMul": 1}
    assert_same(m, out, feed)


# GELU, erf form: Div_0 Erf_1 Add_2 Mul_3 Mul_4, the product in three orders

ERF_INTERMEDIATES = {
    "half_first": ["d", "e", "p", "xh"],
    "x_first": ["d", "e", "p", "xp"],
    "half_last": ["d", "e", "p", "ph"],
}


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize(("order", "tensor"), [(order, t) for order, ts in ERF_INTERMEDIATES.items() for t in ts])
def test_gelu_erf_declines_an_escaping_intermediate(order: str, tensor: str, how: str) -> None:
    m, feed = gelu_erf_graph(order, bias=False)
    out = declined(escaping(m, tensor, how), feed, ["gelu"], "gelu at Erf_1", tensor, how)
    assert "Gelu" not in ops(out) and ops(out)["Erf"] == 1


@pytest.mark.parametrize("order", list(ERF_INTERMEDIATES))
def test_gelu_erf_control_fuses(order: str) -> None:
    m, feed = gelu_erf_graph(order, bias=False)
    out, reports = fuse(m, feed, ["gelu"])
    assert reports["gelu"].fused == 1 and ops(out) == {"Gelu": 1}
    assert_same(m, out, feed)


# GELU, tanh form: Pow_0 Mul_1 Add_2 Mul_3 Tanh_4 Add_5 Mul_6 Mul_7


def gelu_tanh_graph() -> tuple:
    h = 8
    nodes = [
        helper.make_node("Pow", ["x", "three"], ["x3"]),
        helper.make_node("Mul", ["c1", "x3"], ["cx3"]),  # constant first: the operand order must not matter
        helper.make_node("Add", ["cx3", "x"], ["inner"]),
        helper.make_node("Mul", ["c2", "inner"], ["scaled"]),
        helper.make_node("Tanh", ["scaled"], ["t"]),
        helper.make_node("Add", ["one", "t"], ["p"]),
        helper.make_node("Mul", ["half", "x"], ["xh"]),
        helper.make_node("Mul", ["p", "xh"], ["y"]),
    ]
    inits = {
        "three": np.float32(3),
        "c1": np.float32(0.044715),
        "c2": np.float32(math.sqrt(2 / math.pi)),
        "one": np.float32(1),
        "half": np.float32(0.5),
    }
    m = model(nodes, [float_input("x", [2, h])], ["y"], inits)
    return m, {"x": rng.normal(size=(2, h)).astype(np.float32) * 3}


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("tensor", ["x3", "cx3", "inner", "scaled", "t", "p", "xh"])
def test_gelu_tanh_declines_an_escaping_intermediate(tensor: str, how: str) -> None:
    m, feed = gelu_tanh_graph()
    out = declined(escaping(m, tensor, how), feed, ["gelu"], "gelu at Tanh_4", tensor, how)
    assert "FastGelu" not in ops(out) and ops(out)["Tanh"] == 1


def test_gelu_tanh_control_fuses_with_operands_in_either_order() -> None:
    m, feed = gelu_tanh_graph()
    out, reports = fuse(m, feed, ["gelu"])
    assert reports["gelu"].fused == 1 and ops(out) == {"FastGelu": 1}
    assert_same(m, out, feed)


# BiasGelu: Add_0 (x + b) Div_1 Erf_2 Add_3 Mul_4 Mul_5; gelu first makes Erf_2_Gelu


@pytest.mark.parametrize("how", HOWS)
def test_bias_gelu_declines_an_escaping_bias_sum(how: str) -> None:
    m, feed = gelu_erf_graph("half_first", bias=True)
    out = declined(escaping(m, "xb", how), feed, ["gelu", "bias_gelu"], "bias-gelu at Erf_2_Gelu", "xb", how)
    assert ops(out) == Counter({"Add": 1, "Gelu": 1, **({"Neg": 1} if how == "node" else {})})


def test_bias_gelu_control_fuses() -> None:
    m, feed = gelu_erf_graph("half_first", bias=True)
    out, reports = fuse(m, feed, ["gelu", "bias_gelu"])
    assert reports["bias_gelu"].fused == 1 and ops(out) == {"BiasGelu": 1}
    assert_same(m, out, feed)


# Gemm: MatMul_0 Add_1 (2-D input), MatMul_2 Add_3 (3-D input, declined for its shape)


@pytest.mark.parametrize("how", HOWS)
def test_gemm_declines_an_escaping_matmul_output(how: str) -> None:
    m, feed = gemm_graph()
    m2 = escaping(m, "mm", how)
    out, reports = fuse(m2, feed, ["gemm"])
    assert reports["gemm"].fused == 0
    assert reports["gemm"].misses == [
        reason("gemm at MatMul_0", "mm", how),
        "gemm at MatMul_2: input is 3-D, Gemm pays only for 2-D",
    ]
    assert "Gemm" not in ops(out)
    assert_same(m2, out, feed)


def test_gemm_control_fuses() -> None:
    m, feed = gemm_graph()
    out, reports = fuse(m, feed, ["gemm"])
    assert reports["gemm"].fused == 1 and ops(out)["Gemm"] == 1
    assert_same(m, out, feed)


# Conv + BN: Conv_0 BatchNormalization_1 Relu_2 Conv_3 Add_4 Relu_5


@pytest.mark.parametrize("how", HOWS)
def test_conv_bn_declines_an_escaping_conv_output(how: str) -> None:
    m, feed = conv_graph()
    out = declined(escaping(m, "c1", how), feed, ["conv_bn"], "conv-bn at Conv_0", "c1", how)
    assert ops(out)["BatchNormalization"] == 1


def test_conv_bn_control_fuses() -> None:
    m, feed = conv_graph()
    out, reports = fuse(m, feed, ["conv_bn"])
    assert reports["conv_bn"].fused == 1 and "BatchNormalization" not in ops(out)
    assert_same(m, out, feed, atol=1e-4)


# FusedConv: after conv_bn, Conv_0 -> bn -> Relu_2, and Conv_3 -> c2 -> Add_4 (+ x) -> s -> Relu_5


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize(("tensor", "place"), [("bn", "Conv_0"), ("c2", "Conv_3")])
def test_conv_activation_declines_an_escaping_conv_output(tensor: str, place: str, how: str) -> None:
    m, feed = conv_graph()
    m2 = escaping(m, tensor, how)
    out, reports = fuse(m2, feed, ["conv_bn", "conv_activation"])
    report = reports["conv_activation"]
    assert report.fused == 1 and report.misses == [reason(f"conv-activation at {place}", tensor, how)]
    assert ops(out)["FusedConv"] == 1 and ops(out)["Conv"] == 1
    assert_same(m2, out, feed, atol=1e-4)


@pytest.mark.parametrize("how", HOWS)
def test_conv_activation_leaves_a_relu_after_an_escaping_sum_outside(how: str) -> None:
    """Relu after the Add is optional: FusedConv takes Conv + Add and the Relu stays when the sum escapes."""
    m, feed = conv_graph()
    m2 = escaping(m, "s", how)
    out, reports = fuse(m2, feed, ["conv_bn", "conv_activation"])
    assert reports["conv_activation"].fused == 2 and not reports["conv_activation"].misses
    assert ops(out) == Counter({"FusedConv": 2, "Relu": 1, **({"Neg": 1} if how == "node" else {})})
    fused = [n for n in out.graph.node if n.op_type == "FusedConv"]
    assert [len(n.input) for n in fused] == [3, 4] and fused[1].output[0] == "s"
    assert_same(m2, out, feed, atol=1e-4)


def test_conv_activation_control_fuses() -> None:
    m, feed = conv_graph()
    out, reports = fuse(m, feed, ["conv_bn", "conv_activation"])
    assert reports["conv_activation"].fused == 2 and ops(out) == {"FusedConv": 2}
    assert_same(m, out, feed, atol=1e-4)


# Attention over a KV cache (one decode step of layer 0) -> MultiHeadAttention

B, H, D, PAST = 2, 2, 4, 3
E = H * D


def _mask_nodes() -> list[Any]:
    """additive mask [B, 1, 1, T] = (1 - attention_mask) * -10000"""
    return [
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "mask_f"], ["mask_inv"]),
        helper.make_node("Mul", ["mask_inv", "neg"], ["mask_neg"]),
        helper.make_node("Unsqueeze", ["mask_neg", "mask_axes"], ["m"]),
    ]


def _mask_inits() -> dict[str, np.ndarray]:
    return {"one": np.float32(1), "neg": np.float32(-10000), "mask_axes": np.array([1, 2], np.int64)}


def kv_graph() -> tuple:
    """present.0.key/value = Concat(past, new heads); out = softmax(Q K^T / sqrt(D) + M) V back to [B, 1, E]."""
    nodes = [
        helper.make_node("Reshape", ["q_in", "heads"], ["q_r"]),
        helper.make_node("Transpose", ["q_r"], ["q_h"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["k_in", "heads"], ["k_r"]),
        helper.make_node("Transpose", ["k_r"], ["k_h"], perm=[0, 2, 1, 3]),
        helper.make_node("Concat", ["past.0.key", "k_h"], ["present.0.key"], axis=-2),
        helper.make_node("Reshape", ["v_in", "heads"], ["v_r"]),
        helper.make_node("Transpose", ["v_r"], ["v_h"], perm=[0, 2, 1, 3]),
        helper.make_node("Concat", ["past.0.value", "v_h"], ["present.0.value"], axis=-2),
        helper.make_node("Transpose", ["present.0.key"], ["k_t"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q_h", "k_t"], ["qk"]),
        helper.make_node("Mul", ["qk", "scale"], ["scores"]),
        *_mask_nodes(),
        helper.make_node("Add", ["scores", "m"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "present.0.value"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["back"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["back", "merged"], ["out"]),
    ]
    inits = {
        "heads": np.array([0, 0, H, D], np.int64),
        "merged": np.array([0, 0, E], np.int64),
        "scale": np.float32(1 / math.sqrt(D)),
        **_mask_inits(),
    }
    inputs = [
        float_input("q_in", [B, 1, E]),
        float_input("k_in", [B, 1, E]),
        float_input("v_in", [B, 1, E]),
        float_input("past.0.key", [B, H, PAST, D]),
        float_input("past.0.value", [B, H, PAST, D]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [B, PAST + 1]),
    ]
    m = model(nodes, inputs, ["out", "present.0.key", "present.0.value"], inits)
    mask = np.ones((B, PAST + 1), np.int64)
    mask[1, :2] = 0  # left padding
    feed = {n: rng.normal(size=(B, 1, E)).astype(np.float32) for n in ("q_in", "k_in", "v_in")}
    feed |= {n: rng.normal(size=(B, H, PAST, D)).astype(np.float32) for n in ("past.0.key", "past.0.value")}
    return m, feed | {"attention_mask": mask}


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("tensor", ["probs", "scores", "q_h", "back"])
def test_kv_attention_declines_an_escaping_intermediate(tensor: str, how: str) -> None:
    m, feed = kv_graph()
    out = declined(escaping(m, tensor, how), feed, ["kv_attention"], "kv attention of layer 0", tensor, how)
    assert "MultiHeadAttention" not in ops(out) and ops(out)["Softmax"] == 1


def test_kv_attention_keeps_its_cache_outputs_used_elsewhere() -> None:
    """present.0.key is an output of MultiHeadAttention too: another reader of it is no escape."""
    m, feed = kv_graph()
    m2 = escaping(m, "present.0.key", "node")
    out, reports = fuse(m2, feed, ["kv_attention"])
    assert reports["kv_attention"].fused == 1 and ops(out)["MultiHeadAttention"] == 1 and "Softmax" not in ops(out)
    assert_same(m2, out, feed)


def test_kv_attention_control_fuses() -> None:
    m, feed = kv_graph()
    out, reports = fuse(m, feed, ["kv_attention"])
    assert reports["kv_attention"].fused == 1, reports["kv_attention"].misses
    assert ops(out)["MultiHeadAttention"] == 1 and "Softmax" not in ops(out)
    assert_same(m, out, feed)


# Self-attention -> com.microsoft.Attention (passes/fuse/attention.py; its escape check is that module's)


def attention_graph() -> tuple:
    s = 5
    nodes = []
    for p, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [
            helper.make_node("MatMul", ["x", f"w{p}"], [f"{p}0"]),
            helper.make_node("Add", [f"{p}0", f"b{p}"], [f"{p}1"]),
            helper.make_node("Reshape", [f"{p}1", "heads"], [f"{p}2"]),
            helper.make_node("Transpose", [f"{p}2"], [f"{p}h"], perm=perm),
        ]
    nodes += [
        helper.make_node("MatMul", ["qh", "kh"], ["qk"]),
        helper.make_node("Div", ["qk", "sqrt_d"], ["scores"]),
        *_mask_nodes(),
        helper.make_node("Add", ["scores", "m"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("MatMul", ["probs", "vh"], ["ctx"]),
        helper.make_node("Transpose", ["ctx"], ["back"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["back", "merged"], ["out"]),
    ]
    inits: dict[str, np.ndarray] = {
        "heads": np.array([0, 0, H, D], np.int64),
        "merged": np.array([0, 0, E], np.int64),
        "sqrt_d": np.float32(math.sqrt(D)),
        **_mask_inits(),
    }
    for p in "qkv":
        inits[f"w{p}"] = rng.normal(size=(E, E)).astype(np.float32)
        inits[f"b{p}"] = rng.normal(size=E).astype(np.float32)
    inputs = [float_input("x", [B, s, E]), helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [B, s])]
    m = model(nodes, inputs, ["out"], inits)
    mask = np.ones((B, s), np.int64)
    mask[1, -2:] = 0
    return m, {"x": rng.normal(size=(B, s, E)).astype(np.float32), "attention_mask": mask}


@pytest.mark.parametrize("how", HOWS)
def test_attention_declines_an_escaping_intermediate(how: str) -> None:
    m, feed = attention_graph()
    declined(escaping(m, "scores", how), feed, ["attention"], "attention at Softmax_19", "scores", how)


def test_attention_control_fuses() -> None:
    m, feed = attention_graph()
    out, reports = fuse(m, feed, ["attention"])
    assert reports["attention"].fused == 1, reports["attention"].misses
    assert ops(out)["Attention"] == 1 and "Softmax" not in ops(out)
    assert_same(m, out, feed)
