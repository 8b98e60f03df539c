"""MatMul + Add -> Gemm, where it pays.

Gemm(A, B, C) = A B + C in one kernel (bias added in the GEMM epilogue instead of a second pass over the
output). Gemm is defined for 2-D A only, so the rule fires when the probe shows A is 2-D (classifier heads,
poolers, MLPs on flat features); for 3-D activations ORT already folds the bias into its MatMul kernels, and
reshaping to 2-D and back would cost more than it saves.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from passes.fuse.context import RuleContext
from passes.fuse.graph import const, name_of, other_input
from passes.fuse.match import Decline, Match, Steps, consumer, detach, fuse_each
from passes.fuse.rule import RuleReport


@dataclass
class GemmMatch(Match):
    mm: gs.Node
    bias: gs.Tensor


def match_gemm(graph: gs.Graph, ctx: RuleContext, mm: gs.Node) -> GemmMatch | None:
    """MatMul(A, W) + bias, W and bias constant; None where the MatMul's output goes into no such Add."""
    add = consumer(mm.outputs[0], "Add")
    bias = other_input(add, mm.outputs[0]) if add is not None else None
    if add is None or const(bias) is None or const(mm.inputs[1]) is None:
        return None
    return GemmMatch([mm, add], [add.outputs[0]], mm, bias)  # type: ignore[arg-type]


def check_gemm(graph: gs.Graph, ctx: RuleContext, m: GemmMatch) -> None:
    shape = ctx.shape(m.mm.inputs[0])
    if shape is None:  # an untyped intermediate the probe could not run: not a 0-D input
        raise Decline("input shape unknown (no probe value)")
    if len(shape) != 2 or const(m.mm.inputs[1]).ndim != 2 or const(m.bias).ndim > 1:  # type: ignore[union-attr]
        raise Decline(f"input is {len(shape or ())}-D, Gemm pays only for 2-D")


def rewrite_gemm(graph: gs.Graph, ctx: RuleContext, m: GemmMatch) -> None:
    detach(*m.outputs)
    inputs = [m.mm.inputs[0], m.mm.inputs[1], m.bias]
    graph.nodes.append(gs.Node("Gemm", f"{name_of(m.mm)}_Gemm", {}, inputs, m.outputs))


GEMM = Steps("gemm", match_gemm, rewrite_gemm, check_gemm)


def fuse_gemm(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    return fuse_each(graph, ctx, [n for n in graph.nodes if n.op == "MatMul"], GEMM)
