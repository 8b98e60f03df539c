"""Applies the attention fusion (passes/fuse/attention.py has the maths and the matcher)."""

from __future__ import annotations

import onnx_graphsurgeon as gs

from passes.fuse.attention import Decline, find_blocks, mask_index_for, rewrite, validate
from passes.fuse.context import RuleContext
from passes.fuse.probe import mask_input_name
from passes.fuse.rule import RuleReport


def fuse_attention(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    report = RuleReport()
    mask_name = mask_input_name(graph)
    pad = ctx.feed.get(mask_name) if mask_name else None
    mask_index = None
    for block in find_blocks(graph, report):
        try:
            validate(block, ctx.values, pad)
        except (Decline, KeyError) as e:
            reason = str(e) if isinstance(e, Decline) else f"no probe value for {e}"
            report.misses.append(f"attention at {block.name}: {reason}")
            continue
        if "padding" in block.mask_kind and mask_index is None:
            assert mask_name is not None
            mask_index = mask_index_for(graph, next(t for t in graph.inputs if t.name == mask_name))
        rewrite(graph, block, mask_index)
        report.fused += 1
        report.details.append(
            f"attention at {block.name}: {block.heads} heads, mask {block.mask_kind}, scale {block.scale:.4g}"
        )
    return report
