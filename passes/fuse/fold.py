"""Constant folding: every subgraph of constants evaluated once, at fuse time, by GraphSurgeon.

Runs first by default, so the rules after it see folded values as constants."""

from __future__ import annotations

import onnx_graphsurgeon as gs

from optimizer.core.quiet import quiet
from passes.fuse.context import RuleContext
from passes.fuse.rule import RuleReport


def fold_constants(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    before = len(graph.nodes)
    try:
        with quiet():  # GraphSurgeon logs advice about colours and folded tensor sizes to stdout
            graph.fold_constants(error_ok=True).cleanup()
    except Exception as e:  # GraphSurgeon's folding cannot evaluate some graphs (sequence-typed values)
        return RuleReport(skipped=f"constant folding skipped: GraphSurgeon could not fold this graph ({e})")
    return RuleReport(fused=before - len(graph.nodes))
