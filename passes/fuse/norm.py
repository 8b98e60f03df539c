"""LayerNormalization from its decomposed form, and Add + LayerNormalization -> SkipLayerNormalization.

LayerNorm maths: y = (x - mean(x)) / sqrt(var(x) + eps) * gamma + beta over the last axis, with
var(x) = mean((x - mean(x))^2). Older exporters write it as ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt,
Div, Mul, Add; the opset-17 LayerNormalization op computes the same in one kernel, and is what TensorRT and
the CUDA EP prefer, so it is the target on every device.

SkipLayerNormalization (ORT contrib, CPU and CUDA EPs) computes LayerNorm(input + skip [+ bias]) and can also
return input + skip + bias, so a residual sum used again later needs no separate Add. It is used only when
input and skip have the same 3-D shape (checked on the probe), and never for TensorRT.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from passes.fuse.context import RuleContext
from passes.fuse.graph import MS, close_to, const, is_output, name_of, producer, scalar
from passes.fuse.match import Decline, Match, Steps, detach, fuse_each, sole_consumer
from passes.fuse.rule import RuleReport


def _axes(node: gs.Node) -> list[int] | None:
    if "axes" in node.attrs:
        return list(node.attrs["axes"])
    if len(node.inputs) > 1:
        v = const(node.inputs[1])
        return None if v is None else [int(a) for a in v.reshape(-1)]
    return None


def _last_axis(node: gs.Node, rank: int | None) -> bool:
    axes = _axes(node)
    return axes is not None and len(axes) == 1 and (axes[0] == -1 or (rank is not None and axes[0] == rank - 1))


@dataclass
class LayerNormMatch(Match):
    div: gs.Node
    x: gs.Tensor
    eps: float
    gamma: gs.Tensor | None  # None: no Mul by a 1-D constant after the Div
    beta: gs.Tensor | None
    width: int | None  # x's last dim on the probe


def match_layernorm(graph: gs.Graph, ctx: RuleContext, div: gs.Node) -> LayerNormMatch | None:
    """(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) [* gamma [+ beta]] ending at `div`; None where div is
    not Sub / Sqrt. gamma and beta are taken only where the tensor before each is read by nothing else."""
    sub, sqrt = producer(div.inputs[0], "Sub"), producer(div.inputs[1], "Sqrt")
    if sub is None or sqrt is None:
        return None
    x = sub.inputs[0]
    mean = producer(sub.inputs[1], "ReduceMean")
    rank = len(ctx.shape(x) or ()) or None
    if mean is None or mean.inputs[0] is not x or not _last_axis(mean, rank):
        raise Decline("numerator is not x - mean(x) over the last axis")
    add_eps = producer(sqrt.inputs[0], "Add")
    var = producer(add_eps.inputs[0], "ReduceMean") if add_eps is not None else None
    eps = scalar(add_eps.inputs[1]) if add_eps is not None else None
    sq = producer(var.inputs[0], ("Pow", "Mul")) if var is not None else None
    if var is None or eps is None or sq is None or sq.inputs[0] is not sub.outputs[0] or not _last_axis(var, rank):
        raise Decline("denominator is not sqrt(var + eps)")
    if sq.op == "Pow" and not close_to(sq.inputs[1], 2.0) or sq.op == "Mul" and sq.inputs[1] is not sq.inputs[0]:
        raise Decline("variance is not a mean of squares")
    nodes = [mean, sub, sq, var, add_eps, sqrt, div]
    gamma = beta = None
    out = div.outputs[0]
    mul = sole_consumer(graph, out, "Mul")
    if mul is not None and const(mul.inputs[1]) is not None and const(mul.inputs[1]).ndim == 1:
        gamma, out = mul.inputs[1], mul.outputs[0]
        nodes.append(mul)
        add = sole_consumer(graph, out, "Add")
        if add is not None and const(add.inputs[1]) is not None and const(add.inputs[1]).ndim == 1:
            beta, out = add.inputs[1], add.outputs[0]
            nodes.append(add)
    width = (ctx.shape(x) or (None,))[-1]
    return LayerNormMatch(nodes, [out], div, x, float(eps), gamma, beta, width)


def check_layernorm(graph: gs.Graph, ctx: RuleContext, m: LayerNormMatch) -> None:
    if m.width is None and m.gamma is None:
        raise Decline("no gamma and unknown width")


def rewrite_layernorm(graph: gs.Graph, ctx: RuleContext, m: LayerNormMatch) -> None:
    name = name_of(m.div)
    gamma = m.gamma if m.gamma is not None else gs.Constant(f"{name}_ones", np.ones(m.width or 1, np.float32))
    beta = m.beta if m.beta is not None else gs.Constant(f"{name}_zeros", np.zeros(m.width or 1, np.float32))
    detach(*m.outputs)
    attrs = {"axis": -1, "epsilon": m.eps}
    graph.nodes.append(gs.Node("LayerNormalization", f"{name}_LayerNorm", attrs, [m.x, gamma, beta], m.outputs))


LAYERNORM = Steps("layernorm", match_layernorm, rewrite_layernorm, check_layernorm)


def fuse_layernorm(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    return fuse_each(graph, ctx, [n for n in graph.nodes if n.op == "Div"], LAYERNORM)


@dataclass
class SkipLayerNormMatch(Match):
    ln: gs.Node
    inputs: list[gs.Tensor]  # input, skip, gamma, beta[, bias]


def match_skip_layernorm(graph: gs.Graph, ctx: RuleContext, ln: gs.Node) -> SkipLayerNormMatch | None:
    """LayerNormalization(a + b [+ bias]) with constant gamma and beta; None where its input is no Add. The
    residual sum becomes the op's fourth output where something else reads it; a bias Add before `a` is folded
    in only where nothing else reads its output."""
    add = producer(ln.inputs[0], "Add")
    if add is None or len(ln.inputs) < 3 or const(ln.inputs[1]) is None or const(ln.inputs[2]) is None:
        return None
    if int(ln.attrs.get("axis", -1)) != -1 or len([o for o in ln.outputs if o.outputs or is_output(graph, o)]) > 1:
        raise Decline("not a last-axis LayerNorm with one output")
    a, b = add.inputs
    sa, sb = ctx.shape(a), ctx.shape(b)
    if const(a) is None and const(b) is None and (sa is None or sb is None):
        raise Decline("shape of the Add inputs unknown (no probe value)")
    if const(a) is not None or const(b) is not None or sa is None or sa != sb or len(sa) != 3:
        raise Decline("Add inputs are not two same-shape 3-D tensors")
    nodes = [add, ln]
    inputs = [a, b, ln.inputs[1], ln.inputs[2]]
    bias_add = producer(a, "Add")
    if bias_add is not None and sole_consumer(graph, a, "Add") is add:
        bias = next((t for t in bias_add.inputs if const(t) is not None and const(t).ndim == 1), None)
        other = next((t for t in bias_add.inputs if t is not bias), None)
        if bias is not None and other is not None and ctx.shape(other) == sa:
            inputs = [other, b, ln.inputs[1], ln.inputs[2], bias]
            nodes.insert(0, bias_add)
    summed = add.outputs[0]
    outputs = [ln.outputs[0]]
    if [u for u in summed.outputs if u is not ln] or is_output(graph, summed):
        outputs.append(summed)
    return SkipLayerNormMatch(nodes, outputs, ln, inputs)


def rewrite_skip_layernorm(graph: gs.Graph, ctx: RuleContext, m: SkipLayerNormMatch) -> None:
    detach(*m.outputs)
    outputs = list(m.outputs)
    if len(outputs) > 1:  # mean and inverse std dev unused, then input + skip (+ bias)
        outputs[1:1] = [gs.Variable.empty(), gs.Variable.empty()]
    eps = float(m.ln.attrs.get("epsilon", 1e-5))
    graph.nodes.append(
        gs.Node("SkipLayerNormalization", f"{name_of(m.ln)}_Skip", {"epsilon": eps}, m.inputs, outputs, domain=MS)
    )


SKIP_LAYERNORM = Steps("skip-layernorm", match_skip_layernorm, rewrite_skip_layernorm)


def fuse_skip_layernorm(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    anchors = [n for n in graph.nodes if n.op == "LayerNormalization" and n.domain in ("", None)]
    return fuse_each(graph, ctx, anchors, SKIP_LAYERNORM)
