"""Running fusion rules on a graph, and counting what they emitted: shared by the pass on one graph and on a
generation artifact's two (passes/fuse/generation.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from passes.fuse.rule import FUSED_OPS, RULES_BY_NAME, RuleReport

if TYPE_CHECKING:
    import onnx_graphsurgeon as gs

    from passes.fuse.context import RuleContext


def apply_rules(graph: gs.Graph, names: Iterable[str], ctx: RuleContext) -> dict[str, RuleReport]:
    """Run the named rules in order on `graph` (in place); one report per rule, in the same order."""
    rules = [RULES_BY_NAME[n] for n in names]
    off_target = {r.name for r in rules if not r.runs_on(ctx.target)}  # the one target check, before any rewrite
    reports: dict[str, RuleReport] = {}
    for rule in rules:
        if rule.name in off_target:
            reports[rule.name] = RuleReport(skipped=rule.skip_reason(ctx.target))
            continue
        reports[rule.name] = rule.apply(graph, ctx)
        graph.cleanup().toposort()
    return reports


def count_fused(before: Counter[str], after: Counter[str]) -> dict[str, int]:
    """Count of each op type some rule emits, where the graph has more of it than before."""
    return {op: after[op] for op in FUSED_OPS if after[op] > before.get(op, 0)}
