"""MatMul + Add -> Gemm, where it pays.

Gemm(A, B, C) = A B + C in one kernel (bias added in the GEMM epilogue instead of a second pass over the
output). Gemm is defined for 2-D A only, so the rule fires when the probe shows A is 2-D (classifier heads,
poolers, MLPs on flat features); for 3-D activations ORT already folds the bias into its MatMul kernels, and
reshaping to 2-D and back would cost more than it saves.
"""

from __future__ import annotations

import onnx_graphsurgeon as gs

from passes.fuse.context import RuleContext
from passes.fuse.graph import const, name_of, producer
from passes.fuse.rule import RuleReport


def fuse_gemm(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    report = RuleReport()
    for add in [n for n in graph.nodes if n.op == "Add"]:
        for mm_out, bias in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            mm = producer(mm_out, "MatMul")
            b, w = const(bias), const(mm.inputs[1]) if mm is not None else None
            if mm is None or b is None or w is None or len(mm_out.outputs) != 1:
                continue
            shape = ctx.shape(mm.inputs[0])
            if shape is None or len(shape) != 2 or w.ndim != 2 or b.ndim > 1:
                report.misses.append(f"gemm at {name_of(mm)}: input is {len(shape or ())}-D, Gemm pays only for 2-D")
                break
            out = add.outputs[0]
            add.outputs.clear()
            graph.nodes.append(gs.Node("Gemm", f"{name_of(mm)}_Gemm", {}, [mm.inputs[0], mm.inputs[1], bias], [out]))
            report.fused += 1
            break
    return report
