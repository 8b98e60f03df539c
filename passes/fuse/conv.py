"""Conv + BatchNormalization folding, and Conv + Relu / Conv + Add (+ Relu) -> FusedConv.

BN folding: BN(y) = gamma (y - mean) / sqrt(var + eps) + beta with y = W * x + b. With s = gamma / sqrt(var + eps)
per output channel: BN(Conv(x)) = (s W) * x + (s (b - mean) + beta), one Conv with new constant weights.
Exact up to float rounding, for every target.

FusedConv (ORT contrib, CPU EP): Conv whose output is Relu'd, or has a tensor Z added (then optionally Relu'd),
in the same kernel: activation(W * x + b + Z). CPU only: TensorRT and the CUDA EP fuse these themselves.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from passes.fuse.context import RuleContext
from passes.fuse.graph import MS, const, const_tensor, name_of
from passes.fuse.rule import RuleReport


def _only_consumer(t: gs.Tensor, op: str) -> gs.Node | None:
    return t.outputs[0] if len(t.outputs) == 1 and t.outputs[0].op == op else None


def fold_conv_bn(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    report = RuleReport()
    for conv in [n for n in graph.nodes if n.op == "Conv"]:
        bn = _only_consumer(conv.outputs[0], "BatchNormalization")
        if bn is None:
            continue
        w = const(conv.inputs[1])
        params = [const(t) for t in bn.inputs[1:5]]
        if w is None or any(p is None for p in params) or (len(conv.inputs) > 2 and const(conv.inputs[2]) is None):
            report.misses.append(f"conv-bn at {name_of(conv)}: weights or BN statistics are not constant")
            continue
        gamma, beta, mean, var = (np.asarray(p, np.float64) for p in params)  # type: ignore[arg-type]
        b = np.asarray(const(conv.inputs[2]), np.float64) if len(conv.inputs) > 2 else np.zeros(w.shape[0])
        s = gamma / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
        new_w = (w.astype(np.float64) * s.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)
        new_b = (s * (b - mean) + beta).astype(w.dtype)
        out, x = bn.outputs[0], conv.inputs[0]
        bn.outputs.clear()
        bn.inputs.clear()
        conv.inputs.clear()
        conv.inputs.extend(
            [
                x,
                const_tensor(graph, f"{name_of(conv)}_w_bn", new_w),
                const_tensor(graph, f"{name_of(conv)}_b_bn", new_b),
            ]
        )
        conv.outputs.clear()
        conv.outputs.append(out)
        report.fused += 1
    return report


def fuse_conv_activation(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    report = RuleReport()
    for conv in [n for n in graph.nodes if n.op == "Conv" and n.domain in ("", None)]:
        out, z = conv.outputs[0], None
        add = _only_consumer(out, "Add")
        if add is not None:
            other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
            if const(other) is None and ctx.shape(other) == ctx.shape(out):
                z, out = other, add.outputs[0]
        relu = _only_consumer(out, "Relu")
        if relu is None and z is None:
            continue
        final = relu.outputs[0] if relu is not None else out
        attrs = dict(conv.attrs)
        if relu is not None:
            attrs["activation"] = "Relu"
        inputs = list(conv.inputs)
        if z is not None:
            if len(inputs) == 2:
                w = const(inputs[1])
                inputs.append(const_tensor(graph, f"{name_of(conv)}_zero_bias", np.zeros(w.shape[0], w.dtype)))
            inputs.append(z)
        (relu or add).outputs.clear()
        conv.outputs.clear()
        graph.nodes.append(gs.Node("FusedConv", f"{name_of(conv)}_Fused", attrs, inputs, [final], domain=MS))
        report.fused += 1
    return report
