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

import numpy as np
import onnx_graphsurgeon as gs

from passes.fuse.context import RuleContext
from passes.fuse.graph import MS, close_to, const, is_output, name_of, producer, scalar
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


def fuse_layernorm(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    report = RuleReport()
    for div in [n for n in graph.nodes if n.op == "Div"]:
        sub, sqrt = producer(div.inputs[0], "Sub"), producer(div.inputs[1], "Sqrt")
        if sub is None or sqrt is None:
            continue
        x = sub.inputs[0]
        mean = producer(sub.inputs[1], "ReduceMean")
        rank = len(ctx.shape(x) or ()) or None
        if mean is None or mean.inputs[0] is not x or not _last_axis(mean, rank):
            report.misses.append(f"layernorm at {name_of(div)}: numerator is not x - mean(x) over the last axis")
            continue
        add_eps = producer(sqrt.inputs[0], "Add")
        var = producer(add_eps.inputs[0], "ReduceMean") if add_eps is not None else None
        eps = scalar(add_eps.inputs[1]) if add_eps is not None else None
        sq = producer(var.inputs[0], ("Pow", "Mul")) if var is not None else None
        if var is None or eps is None or sq is None or sq.inputs[0] is not sub.outputs[0]:
            report.misses.append(f"layernorm at {name_of(div)}: denominator is not sqrt(var + eps)")
            continue
        if sq.op == "Pow" and not close_to(sq.inputs[1], 2.0) or sq.op == "Mul" and sq.inputs[1] is not sq.inputs[0]:
            report.misses.append(f"layernorm at {name_of(div)}: variance is not a mean of squares")
            continue
        y = div.outputs[0]
        width = (ctx.shape(x) or (None,))[-1]
        gamma: gs.Tensor = gs.Constant(f"{name_of(div)}_ones", np.ones(width or 1, np.float32))
        beta: gs.Tensor = gs.Constant(f"{name_of(div)}_zeros", np.zeros(width or 1, np.float32))
        out = y
        mul = y.outputs[0] if len(y.outputs) == 1 and y.outputs[0].op == "Mul" else None
        if mul is not None and const(mul.inputs[1]) is not None and const(mul.inputs[1]).ndim == 1:
            gamma, out = mul.inputs[1], mul.outputs[0]
            add = out.outputs[0] if len(out.outputs) == 1 and out.outputs[0].op == "Add" else None
            if add is not None and const(add.inputs[1]) is not None and const(add.inputs[1]).ndim == 1:
                beta, out = add.inputs[1], add.outputs[0]
        if width is None and gamma.name.endswith("_ones"):
            report.misses.append(f"layernorm at {name_of(div)}: no gamma and unknown width")
            continue
        tail = out.inputs[0]
        tail.outputs.clear()
        graph.nodes.append(
            gs.Node(
                "LayerNormalization",
                f"{name_of(div)}_LayerNorm",
                {"axis": -1, "epsilon": float(eps)},
                [x, gamma, beta],
                [out],
            )
        )
        report.fused += 1
    return report


def fuse_skip_layernorm(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    report = RuleReport()
    for ln in [n for n in graph.nodes if n.op == "LayerNormalization" and n.domain in ("", None)]:
        add = producer(ln.inputs[0], "Add")
        if add is None or len(ln.inputs) < 3 or const(ln.inputs[1]) is None or const(ln.inputs[2]) is None:
            continue
        if int(ln.attrs.get("axis", -1)) != -1 or len([o for o in ln.outputs if o.outputs or is_output(graph, o)]) > 1:
            report.misses.append(f"skip-layernorm at {name_of(ln)}: not a last-axis LayerNorm with one output")
            continue
        a, b = add.inputs
        sa, sb = ctx.shape(a), ctx.shape(b)
        if const(a) is not None or const(b) is not None or sa is None or sa != sb or len(sa) != 3:
            report.misses.append(f"skip-layernorm at {name_of(ln)}: Add inputs are not two same-shape 3-D tensors")
            continue
        inputs = [a, b, ln.inputs[1], ln.inputs[2]]
        # Fold a bias Add feeding the first input (MatMul + bias) into the op as well.
        bias_add = producer(a, "Add")
        if bias_add is not None and len(a.outputs) == 1:
            bias = next((t for t in bias_add.inputs if const(t) is not None and const(t).ndim == 1), None)
            other = next((t for t in bias_add.inputs if t is not bias), None)
            if bias is not None and other is not None and ctx.shape(other) == sa:
                inputs = [other, b, ln.inputs[1], ln.inputs[2], bias]
        outputs = [ln.outputs[0]]
        summed = add.outputs[0]
        uses_elsewhere = [u for u in summed.outputs if u is not ln] or is_output(graph, summed)
        add.outputs.clear()
        ln.outputs.clear()
        if uses_elsewhere:
            empty1, empty2 = gs.Variable.empty(), gs.Variable.empty()
            outputs += [empty1, empty2, summed]
        eps = float(ln.attrs.get("epsilon", 1e-5))
        graph.nodes.append(
            gs.Node("SkipLayerNormalization", f"{name_of(ln)}_Skip", {"epsilon": eps}, inputs, outputs, domain=MS)
        )
        report.fused += 1
    return report
