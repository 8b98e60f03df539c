"""Conv + BatchNormalization folding, and Conv + Relu / Conv + Add (+ Relu) -> FusedConv.

BN folding: BN(y) = gamma (y - mean) / sqrt(var + eps) + beta with y = W * x + b. With s = gamma / sqrt(var + eps)
per output channel: BN(Conv(x)) = (s W) * x + (s (b - mean) + beta), one Conv with new constant weights.
Exact up to float rounding, for every target.

FusedConv (ORT contrib, CPU EP): Conv whose output is Relu'd, or has a tensor Z added (then optionally Relu'd),
in the same kernel: activation(W * x + b + Z). CPU only: TensorRT and the CUDA EP fuse these themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from passes.fuse.context import RuleContext
from passes.fuse.graph import MS, const, const_tensor, name_of
from passes.fuse.match import Decline, Match, Steps, commuted, consumer, detach, fuse_each, sole_consumer
from passes.fuse.rule import RuleReport


@dataclass
class ConvBnMatch(Match):
    conv: gs.Node
    bn: gs.Node


def match_conv_bn(graph: gs.Graph, ctx: RuleContext, conv: gs.Node) -> ConvBnMatch | None:
    """BatchNormalization of a Conv's output, with constant weights and statistics; None where no BN reads it."""
    bn = consumer(conv.outputs[0], "BatchNormalization")
    if bn is None or bn.inputs[0] is not conv.outputs[0]:
        return None
    params = [const(t) for t in bn.inputs[1:5]]
    if (
        const(conv.inputs[1]) is None
        or any(p is None for p in params)
        or (len(conv.inputs) > 2 and const(conv.inputs[2]) is None)
    ):
        raise Decline("weights or BN statistics are not constant")
    return ConvBnMatch([conv, bn], [bn.outputs[0]], conv, bn)


def rewrite_conv_bn(graph: gs.Graph, ctx: RuleContext, m: ConvBnMatch) -> None:
    """The Conv, with the folded weights and bias, produces the BN's output in place of it."""
    conv, bn = m.conv, m.bn
    w = const(conv.inputs[1])
    assert w is not None
    gamma, beta, mean, var = (np.asarray(const(t), np.float64) for t in bn.inputs[1:5])
    b = np.asarray(const(conv.inputs[2]), np.float64) if len(conv.inputs) > 2 else np.zeros(w.shape[0])
    s = gamma / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
    new_w = (w.astype(np.float64) * s.reshape(-1, *([1] * (w.ndim - 1)))).astype(w.dtype)
    new_b = (s * (b - mean) + beta).astype(w.dtype)
    x = conv.inputs[0]
    detach(*m.outputs)
    conv.inputs.clear()
    conv.inputs.extend(
        [
            x,
            const_tensor(graph, f"{name_of(conv)}_w_bn", new_w),
            const_tensor(graph, f"{name_of(conv)}_b_bn", new_b),
        ]
    )
    conv.outputs.clear()
    conv.outputs.extend(m.outputs)


CONV_BN = Steps("conv-bn", match_conv_bn, rewrite_conv_bn)


def fold_conv_bn(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    return fuse_each(graph, ctx, [n for n in graph.nodes if n.op == "Conv"], CONV_BN)


@dataclass
class ConvActivationMatch(Match):
    conv: gs.Node
    z: gs.Tensor | None  # the tensor added to the Conv's output
    relu: bool


def match_conv_activation(graph: gs.Graph, ctx: RuleContext, conv: gs.Node) -> ConvActivationMatch | None:
    """Conv + Z (a same-shape non-constant tensor), then optionally Relu; or Conv + Relu. None where the Conv's
    output goes into neither. The Relu after the Add is taken only where nothing else reads the sum."""
    y = conv.outputs[0]
    nodes, out, z = [conv], y, None
    add = consumer(y, "Add")
    pair = None
    if add is not None:
        pair = commuted(
            add.inputs, lambda a, b: a is y and b is not y and const(b) is None and ctx.shape(b) == ctx.shape(y)
        )
    if pair is not None:
        z, out = pair[1], add.outputs[0]  # type: ignore[union-attr]
        nodes.append(add)  # type: ignore[arg-type]
        relu = sole_consumer(graph, out, "Relu")
    else:
        relu = consumer(y, "Relu")
    if relu is None and z is None:
        return None
    if relu is not None:
        nodes.append(relu)
        out = relu.outputs[0]
    return ConvActivationMatch(nodes, [out], conv, z, relu is not None)


def rewrite_conv_activation(graph: gs.Graph, ctx: RuleContext, m: ConvActivationMatch) -> None:
    conv = m.conv
    attrs = dict(conv.attrs)
    if m.relu:
        attrs["activation"] = "Relu"
    inputs = list(conv.inputs)
    if m.z is not None:
        if len(inputs) == 2:
            w = const(inputs[1])
            assert w is not None
            inputs.append(const_tensor(graph, f"{name_of(conv)}_zero_bias", np.zeros(w.shape[0], w.dtype)))
        inputs.append(m.z)
    detach(*m.outputs)
    graph.nodes.append(gs.Node("FusedConv", f"{name_of(conv)}_Fused", attrs, inputs, m.outputs, domain=MS))


CONV_ACTIVATION = Steps("conv-activation", match_conv_activation, rewrite_conv_activation)


def fuse_conv_activation(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    return fuse_each(graph, ctx, [n for n in graph.nodes if n.op == "Conv" and n.domain in ("", None)], CONV_ACTIVATION)
