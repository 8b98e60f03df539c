"""A fusion rule as a declared object, and the rules the `fuse` pass knows.

Each rule declares its name, the targets its fused ops run on, the op types it emits, and where its rewrite
lives; `apply` runs the rewrite and returns a `RuleReport`. The declarations import no graph library, so loading
a recipe (which validates `fuse`'s config against `RULE_NAMES`) stays fast; a rewrite is imported when it first
runs, the way the pass registry imports passes. Rewrites are match -> check -> rewrite steps run by one driver
(passes/fuse/match.py), which also declines a match whose intermediates escape it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from passes.fuse.targets import ALL_TARGETS, CONTRIB_TARGETS, Target

if TYPE_CHECKING:
    import onnx_graphsurgeon as gs

    from passes.fuse.context import RuleContext



@dataclass
class RuleReport:
    """What one rule did: how many fusions, the places it declined (with the reason), and, when it did not run
    at all, why."""

    fused: int = 0
    misses: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    skipped: str | None = None

    @property
    def matched(self) -> int:
        """Places the rule's pattern was found: each one was either fused or declined with a reason."""
        return self.fused + len(self.misses)

    def to_json(self) -> dict[str, Any]:
        # `not_fused` keeps the skip reason first, as it was when rules reported their own target check.
        not_fused = ([self.skipped] if self.skipped else []) + self.misses
        d: dict[str, Any] = {"fused": self.fused, "not_fused": not_fused, "matched": self.matched}
        if self.details:
            d["details"] = self.details
        if self.skipped:
            d["skipped"] = self.skipped
        return d


RuleFn = Callable[["gs.Graph", "RuleContext"], RuleReport]


@dataclass(frozen=True)
class FusionRule:
    name: str
    targets: frozenset[Target]
    emits: tuple[str, ...]  # op types the rule writes into the graph (the stage's `fused_ops` are counted over these)
    impl: str  # "module:function" of the rewrite
    off_target: str = "{name}: not used for target {target}"  # the report's reason on a target not in `targets`
    # ONNX Runtime's own load-time fusions of the same pattern (its graph transformers' names): disabled in the
    # artifact's runtime when the rule is measured slower and left out, or ORT would make the fusion again.
    ort_fusions: tuple[str, ...] = ()
    # Runs on a generation artifact's graphs (prefill + decode with their KV cache). The other rules need a probe
    # run of the graph, which has no inputs for the cache yet.
    generation: bool = False

    def runs_on(self, target: Target) -> bool:
        return target in self.targets

    def skip_reason(self, target: Target) -> str:
        return self.off_target.format(name=self.name, target=target)

    def apply(self, graph: gs.Graph, ctx: RuleContext) -> RuleReport:
        """Rewrite `graph` in place. The caller has checked `runs_on(ctx.target)`."""
        module, func = self.impl.split(":")
        fn: RuleFn = getattr(importlib.import_module(module), func)
        return fn(graph, ctx)


# The default order: each rule sees the previous one's output (SkipLayerNorm needs LayerNorm's op, BiasGelu
# needs Gelu's, FusedConv wants BN already folded into the Conv).
RULES: tuple[FusionRule, ...] = (
    FusionRule("constant_folding", ALL_TARGETS, (), "passes.fuse.fold:fold_constants"),
    FusionRule("layernorm", ALL_TARGETS, ("LayerNormalization",), "passes.fuse.norm:fuse_layernorm"),
    # cpu/cuda: com.microsoft Gelu/FastGelu; tensorrt: ONNX Gelu at opset >= 20 (declined per place below that).
    FusionRule("gelu", ALL_TARGETS, ("Gelu", "FastGelu"), "passes.fuse.gelu:fuse_gelu"),
    FusionRule(
        "attention",
        CONTRIB_TARGETS,
        ("Attention",),
        "passes.fuse.attention_rule:fuse_attention",
        "attention: com.microsoft.Attention is not available for target {target}",
    ),
    FusionRule(
        "skip_layernorm",
        CONTRIB_TARGETS,
        ("SkipLayerNormalization",),
        "passes.fuse.norm:fuse_skip_layernorm",
        "skip-layernorm: not used for target {target} (kept standard LayerNormalization)",
        ort_fusions=("SkipLayerNormFusion",),
    ),
    FusionRule(
        "bias_gelu",
        CONTRIB_TARGETS,
        ("BiasGelu", "FastGelu"),
        "passes.fuse.gelu:fuse_bias_gelu",
        "bias-gelu: not used for target {target}",
        ort_fusions=("BiasGeluFusion",),
    ),
    FusionRule(
        "kv_attention",
        frozenset({"cpu"}),
        ("MultiHeadAttention",),
        "passes.fuse.kv_attention:fuse_kv_attention",
        "kv_attention: MultiHeadAttention over a KV cache is checked on ONNX Runtime's CPU kernel only, not on "
        "target {target}",
        generation=True,
    ),
    FusionRule("gemm", ALL_TARGETS, ("Gemm",), "passes.fuse.gemm:fuse_gemm"),
    # Folding rewrites the Conv's constants in place: no new op type.
    FusionRule("conv_bn", ALL_TARGETS, (), "passes.fuse.conv:fold_conv_bn"),
    FusionRule(
        "conv_activation",
        frozenset({"cpu"}),
        ("FusedConv",),
        "passes.fuse.conv:fuse_conv_activation",
        "conv-activation: FusedConv is a CPU kernel; target {target} fuses this itself",
    ),
)
RULES_BY_NAME: dict[str, FusionRule] = {r.name: r for r in RULES}
RULE_NAMES: tuple[str, ...] = tuple(RULES_BY_NAME)
# Every op type some rule emits, in rule order: what the stage notes count as fused.
FUSED_OPS: tuple[str, ...] = tuple(dict.fromkeys(op for r in RULES for op in r.emits))
