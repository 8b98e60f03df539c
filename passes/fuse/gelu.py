"""GELU from its decomposed forms, and bias + GELU -> one op.

erf form:   gelu(x) = 0.5 x (1 + erf(x / sqrt(2)))
tanh form:  gelu(x) ~ 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
The product 0.5 * x * (1 + ...) is matched in the three orders exporters write it.
Targets: CPU/CUDA -> com.microsoft Gelu / FastGelu (ORT kernels); TensorRT -> ONNX Gelu (opset >= 20,
approximate="none"|"tanh"), or left decomposed below opset 20.
BiasGelu: gelu(x + b) with a constant 1-D b -> com.microsoft.BiasGelu(x, b) (erf) or FastGelu(x, b) (tanh),
which saves one pass over the activation; ORT-only, so not for TensorRT.
"""

from __future__ import annotations

import math

import onnx_graphsurgeon as gs

from passes.fuse.context import RuleContext
from passes.fuse.graph import MS, close_to, const, name_of, other_input, producer
from passes.fuse.rule import RuleReport

SQRT2 = math.sqrt(2.0)
TANH_C = math.sqrt(2.0 / math.pi)


def _consumer(t: gs.Tensor, op: str) -> gs.Node | None:
    return t.outputs[0] if len(t.outputs) == 1 and t.outputs[0].op == op else None


def _half_x_times(one_plus: gs.Tensor, x: gs.Tensor) -> gs.Tensor | None:
    """The output of 0.5 * x * one_plus in any of its three common orders, else None."""
    m1 = _consumer(one_plus, "Mul")
    if m1 is None:
        return None
    o = other_input(m1, one_plus)
    if close_to(o, 0.5):  # (one_plus * 0.5) * x
        m2 = _consumer(m1.outputs[0], "Mul")
        return m2.outputs[0] if m2 is not None and other_input(m2, m1.outputs[0]) is x else None
    if o is x:  # (x * one_plus) * 0.5
        m2 = _consumer(m1.outputs[0], "Mul")
        return m2.outputs[0] if m2 is not None and close_to(other_input(m2, m1.outputs[0]), 0.5) else None
    half = producer(o, "Mul")  # (x * 0.5) * one_plus
    if half is not None and x in half.inputs and close_to(other_input(half, x), 0.5):
        return m1.outputs[0]
    return None


def _one_plus(t: gs.Tensor) -> gs.Tensor | None:
    add = _consumer(t, "Add")
    return add.outputs[0] if add is not None and close_to(other_input(add, t), 1.0) else None


def _erf_input(erf: gs.Node) -> gs.Tensor | None:
    node = producer(erf.inputs[0], ("Div", "Mul"))
    if node is None:
        return None
    if node.op == "Div" and close_to(node.inputs[1], SQRT2):
        return node.inputs[0]
    if node.op == "Mul":
        for a, b in (node.inputs, node.inputs[::-1]):
            if close_to(b, 1 / SQRT2):
                return a
    return None


def _tanh_input(tanh: gs.Node) -> gs.Tensor | None:
    scale = producer(tanh.inputs[0], "Mul")
    if scale is None:
        return None
    inner = next((t for t in scale.inputs if not close_to(t, TANH_C)), None)
    if inner is None or not any(close_to(t, TANH_C) for t in scale.inputs):
        return None
    add = producer(inner, "Add")
    if add is None:
        return None
    for x, cube_term in (add.inputs, add.inputs[::-1]):
        mul = producer(cube_term, "Mul")
        if mul is None or not any(close_to(t, 0.044715) for t in mul.inputs):
            continue
        cube = next(t for t in mul.inputs if not close_to(t, 0.044715))
        pw = producer(cube, "Pow")
        if pw is not None and pw.inputs[0] is x and close_to(pw.inputs[1], 3.0):
            return x
    return None


def _gelu_op(ctx: RuleContext, tanh: bool) -> tuple[str, dict[str, str], str | None] | None:
    """(op, attrs, domain) of the GELU node for this target and opset, or None where there is none."""
    if ctx.contrib_ok:
        return ("FastGelu" if tanh else "Gelu"), {}, MS
    if ctx.opset >= 20:
        return "Gelu", {"approximate": "tanh" if tanh else "none"}, None
    return None


def fuse_gelu(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    report = RuleReport()
    for node in [n for n in graph.nodes if n.op in ("Erf", "Tanh")]:
        x = _erf_input(node) if node.op == "Erf" else _tanh_input(node)
        one_plus = _one_plus(node.outputs[0]) if x is not None else None
        out = _half_x_times(one_plus, x) if one_plus is not None and x is not None else None
        if out is None:
            report.misses.append(
                f"gelu at {name_of(node)}: not 0.5 * x * (1 + {node.op.lower()}(...)) of the expected form"
            )
            continue
        gelu = _gelu_op(ctx, node.op == "Tanh")
        if gelu is None:  # decided before detaching `out`, so a declined place keeps its decomposed form
            report.misses.append(f"gelu at {name_of(node)}: opset {ctx.opset} < 20 has no Gelu for {ctx.target}")
            continue
        op, attrs, domain = gelu
        out.inputs[0].outputs.clear()
        graph.nodes.append(gs.Node(op, f"{name_of(node)}_Gelu", attrs, [x], [out], domain=domain))
        report.fused += 1
    return report


def fuse_bias_gelu(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    report = RuleReport()
    for gelu in [n for n in graph.nodes if n.op in ("Gelu", "FastGelu")]:
        is_onnx = gelu.domain in ("", None)
        tanh = gelu.op == "FastGelu" or (is_onnx and gelu.attrs.get("approximate", "none") == "tanh")
        if gelu.op == "FastGelu" and len(gelu.inputs) > 1:
            continue  # already has its bias
        add = producer(gelu.inputs[0], "Add")
        if add is None or len(add.outputs[0].outputs) != 1:
            continue
        bias = next((t for t in add.inputs if const(t) is not None and const(t).ndim == 1), None)
        x = next((t for t in add.inputs if t is not bias), None)
        if bias is None or x is None:
            report.misses.append(f"bias-gelu at {name_of(gelu)}: the Add before it has no constant 1-D bias")
            continue
        out = gelu.outputs[0]
        gelu.outputs.clear()
        op = "FastGelu" if tanh else "BiasGelu"
        graph.nodes.append(gs.Node(op, f"{name_of(gelu)}_Bias", {}, [x, bias], [out], domain=MS))
        report.fused += 1
    return report
