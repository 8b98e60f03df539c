"""GELU from its decomposed forms, and bias + GELU -> one op.

erf form:   gelu(x) = 0.5 x (1 + erf(x / sqrt(2)))
tanh form:  gelu(x) ~ 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
The product 0.5 * x * (1 + ...) is matched in any grouping of its two Muls and any operand order.
Targets: CPU/CUDA -> com.microsoft Gelu / FastGelu (ORT kernels); TensorRT -> ONNX Gelu (opset >= 20,
approximate="none"|"tanh"), or left decomposed below opset 20.
BiasGelu: gelu(x + b) with a constant 1-D b -> com.microsoft.BiasGelu(x, b) (erf) or FastGelu(x, b) (tanh),
which saves one pass over the activation; ORT-only, so not for TensorRT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx_graphsurgeon as gs

from passes.fuse.context import RuleContext
from passes.fuse.graph import MS, close_to, const, name_of, other_input, producer
from passes.fuse.match import Decline, Match, Steps, commuted, consumer, detach, fuse_each
from passes.fuse.rule import RuleReport

SQRT2 = math.sqrt(2.0)
TANH_C = math.sqrt(2.0 / math.pi)


def _half(t: gs.Tensor | None) -> bool:
    return close_to(t, 0.5)


def _half_x_times(one_plus: gs.Tensor, x: gs.Tensor) -> tuple[gs.Tensor, list[gs.Node]] | None:
    """0.5 * x * one_plus as two Muls, in any grouping and operand order: (the product, the two Muls)."""
    m1 = consumer(one_plus, "Mul")
    if m1 is None:
        return None
    o = other_input(m1, one_plus)
    if o is x or _half(o):  # (one_plus * 0.5) * x, (x * one_plus) * 0.5
        m2 = consumer(m1.outputs[0], "Mul")
        if m2 is None or not commuted((o, other_input(m2, m1.outputs[0])), lambda a, b: a is x and _half(b)):
            return None
        return m2.outputs[0], [m1, m2]
    half_x = producer(o, "Mul")  # (x * 0.5) * one_plus
    if half_x is None or not commuted(half_x.inputs, lambda a, b: a is x and _half(b)):
        return None
    return m1.outputs[0], [half_x, m1]


def _erf_input(erf: gs.Node) -> tuple[gs.Tensor, list[gs.Node]] | None:
    """x where erf's input is x / sqrt(2) or x * (1 / sqrt(2)), with that node."""
    node = producer(erf.inputs[0], ("Div", "Mul"))
    if node is None:
        return None
    if node.op == "Div" and close_to(node.inputs[1], SQRT2):
        return node.inputs[0], [node]
    pair = commuted(node.inputs, lambda a, b: close_to(b, 1 / SQRT2)) if node.op == "Mul" else None
    return (pair[0], [node]) if pair is not None else None


def _cube_term(x: gs.Tensor, term: gs.Tensor) -> list[gs.Node] | None:
    """The Pow and the Mul where term = 0.044715 * x^3."""
    mul = producer(term, "Mul")
    pair = commuted(mul.inputs, lambda c, cube: close_to(c, 0.044715)) if mul is not None else None
    pw = producer(pair[1], "Pow") if pair is not None else None
    if mul is None or pw is None or pw.inputs[0] is not x or not close_to(pw.inputs[1], 3.0):
        return None
    return [pw, mul]


def _tanh_input(tanh: gs.Node) -> tuple[gs.Tensor, list[gs.Node]] | None:
    """x where tanh's input is sqrt(2/pi) (x + 0.044715 x^3), with the nodes computing it from x."""
    scale = producer(tanh.inputs[0], "Mul")
    pair = commuted(scale.inputs, lambda inner, c: close_to(c, TANH_C)) if scale is not None else None
    add = producer(pair[0], "Add") if pair is not None else None
    terms = commuted(add.inputs, lambda x, term: _cube_term(x, term) is not None) if add is not None else None
    if scale is None or add is None or terms is None:
        return None
    x, term = terms
    return x, [*(_cube_term(x, term) or []), add, scale]


def _gelu_op(ctx: RuleContext, tanh: bool) -> tuple[str, dict[str, str], str | None] | None:
    """(op, attrs, domain) of the GELU node for this target and opset, or None where there is none."""
    if ctx.contrib_ok:
        return ("FastGelu" if tanh else "Gelu"), {}, MS
    if ctx.opset >= 20:
        return "Gelu", {"approximate": "tanh" if tanh else "none"}, None
    return None


@dataclass
class GeluMatch(Match):
    at: gs.Node  # the Erf or Tanh
    x: gs.Tensor


def match_gelu(graph: gs.Graph, ctx: RuleContext, node: gs.Node) -> GeluMatch:
    """0.5 x (1 + erf(x / sqrt 2)) or 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) around an Erf or Tanh."""
    found = _erf_input(node) if node.op == "Erf" else _tanh_input(node)
    add = consumer(node.outputs[0], "Add") if found is not None else None
    one_plus = add.outputs[0] if add is not None and close_to(other_input(add, node.outputs[0]), 1.0) else None
    product = _half_x_times(one_plus, found[0]) if one_plus is not None and found is not None else None
    if found is None or add is None or product is None:
        raise Decline(f"not 0.5 * x * (1 + {node.op.lower()}(...)) of the expected form")
    (x, before), (out, muls) = found, product
    return GeluMatch([*before, node, add, *muls], [out], node, x)


def check_gelu(graph: gs.Graph, ctx: RuleContext, m: GeluMatch) -> None:
    if _gelu_op(ctx, m.at.op == "Tanh") is None:
        raise Decline(f"opset {ctx.opset} < 20 has no Gelu for {ctx.target}")


def rewrite_gelu(graph: gs.Graph, ctx: RuleContext, m: GeluMatch) -> None:
    op, attrs, domain = _gelu_op(ctx, m.at.op == "Tanh")  # type: ignore[misc]
    detach(*m.outputs)
    graph.nodes.append(gs.Node(op, f"{name_of(m.at)}_Gelu", attrs, [m.x], m.outputs, domain=domain))


GELU = Steps("gelu", match_gelu, rewrite_gelu, check_gelu)


def fuse_gelu(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    return fuse_each(graph, ctx, [n for n in graph.nodes if n.op in ("Erf", "Tanh")], GELU)


@dataclass
class BiasGeluMatch(Match):
    gelu: gs.Node
    x: gs.Tensor
    bias: gs.Tensor


def match_bias_gelu(graph: gs.Graph, ctx: RuleContext, gelu: gs.Node) -> BiasGeluMatch | None:
    """Gelu / FastGelu (without a bias yet) of x + b with a constant 1-D b; None where its input is no Add."""
    if gelu.op == "FastGelu" and len(gelu.inputs) > 1:
        return None  # already has its bias
    add = producer(gelu.inputs[0], "Add")
    if add is None:
        return None
    pair = commuted(add.inputs, lambda x, b: (v := const(b)) is not None and v.ndim == 1)
    if pair is None:
        raise Decline("the Add before it has no constant 1-D bias")
    return BiasGeluMatch([add, gelu], [gelu.outputs[0]], gelu, *pair)


def rewrite_bias_gelu(graph: gs.Graph, ctx: RuleContext, m: BiasGeluMatch) -> None:
    is_onnx = m.gelu.domain in ("", None)
    tanh = m.gelu.op == "FastGelu" or (is_onnx and m.gelu.attrs.get("approximate", "none") == "tanh")
    detach(*m.outputs)
    op = "FastGelu" if tanh else "BiasGelu"
    graph.nodes.append(gs.Node(op, f"{name_of(m.gelu)}_Bias", {}, [m.x, m.bias], m.outputs, domain=MS))


BIAS_GELU = Steps("bias-gelu", match_bias_gelu, rewrite_bias_gelu)


def fuse_bias_gelu(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    return fuse_each(graph, ctx, [n for n in graph.nodes if n.op in ("Gelu", "FastGelu")], BIAS_GELU)
