"""The `fuse` pass: our own fusion rules over the exported graph, device-aware, numerically checked.

Rules run in a fixed order (each sees the previous one's output): constant folding, LayerNorm, GELU,
attention (with QKV merge), SkipLayerNorm, BiasGelu, Gemm, Conv+BN folding, Conv+activation. Every rule
reports what it fused and every place it looked at and declined, with the reason. The fused graph is then run
against its input graph on every scenario's inputs; below `min_cosine` the stage fails rather than passing a
wrong graph on.

Per target: cpu uses ORT contrib kernels (Attention, SkipLayerNormalization, BiasGelu, FastGelu, FusedConv);
cuda the same minus FusedConv (the CUDA EP fuses Conv+activation itself); tensorrt only standard ONNX ops
(LayerNormalization, Gelu at opset >= 20, folded Conv+BN), because TensorRT cannot run com.microsoft ops
and prefers the opset-17 LayerNormalization.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Literal

from pydantic import Field

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassResult

RULE_NAMES = (
    "constant_folding",
    "layernorm",
    "gelu",
    "attention",
    "skip_layernorm",
    "bias_gelu",
    "gemm",
    "conv_bn",
    "conv_activation",
)


class FuseConfig(PassConfig):
    rules: list[Literal[RULE_NAMES]] = Field(default_factory=lambda: list(RULE_NAMES))  # type: ignore[valid-type]
    target: Literal["auto", "cpu", "cuda", "tensorrt"] = Field(default="auto", description="auto: the recipe's device")
    min_cosine: float = Field(default=0.99999, description="reject the fused graph below this cosine vs its input")


def _rules() -> dict[str, Callable]:  # type: ignore[type-arg]
    from passes.fuse.attention_rule import fuse_attention
    from passes.fuse.conv import fold_conv_bn, fuse_conv_activation
    from passes.fuse.gelu import fuse_bias_gelu, fuse_gelu
    from passes.fuse.gemm import fuse_gemm
    from passes.fuse.graph import RuleReport
    from passes.fuse.norm import fuse_layernorm, fuse_skip_layernorm

    def fold(graph, ctx):  # type: ignore[no-untyped-def]
        from optimizer.core.quiet import quiet

        before = len(graph.nodes)
        try:
            with quiet():  # GraphSurgeon logs advice about colours and folded tensor sizes to stdout
                graph.fold_constants(error_ok=True).cleanup()
        except Exception as e:  # GraphSurgeon's folding cannot evaluate some graphs (sequence-typed values)
            return RuleReport(misses=[f"constant folding skipped: GraphSurgeon could not fold this graph ({e})"])
        return RuleReport(fused=before - len(graph.nodes))

    return {
        "constant_folding": fold,
        "layernorm": fuse_layernorm,
        "gelu": fuse_gelu,
        "attention": fuse_attention,
        "skip_layernorm": fuse_skip_layernorm,
        "bias_gelu": fuse_bias_gelu,
        "gemm": fuse_gemm,
        "conv_bn": fold_conv_bn,
        "conv_activation": fuse_conv_activation,
    }


class FusePass(Pass):
    name = "fuse"
    summary = "our fusion rules: attention+QKV merge, LayerNorm/SkipLayerNorm, GELU/BiasGelu, Gemm, Conv+BN/act"
    Config = FuseConfig
    consumes = frozenset({"onnx"})
    requires = ("onnx_graphsurgeon", "onnxruntime")

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        import onnx_graphsurgeon as gs

        from optimizer.runtime import onnx_io
        from passes.fuse.check import compare_graphs
        from passes.fuse.context import RuleContext
        from passes.fuse.graph import name_nodes
        from passes.fuse.probe import add_contrib_opset, mask_input_name, probe_values, run_probe

        cfg: FuseConfig = self.config  # type: ignore[assignment]
        target = ctx.recipe.target.device if cfg.target == "auto" else cfg.target
        assert artifact.path is not None
        source_model = onnx_io.load(artifact.path)
        graph = gs.import_onnx(source_model)
        name_nodes(graph)
        opset = int(graph.opset)
        before = Counter(n.op for n in graph.nodes)
        try:
            feed, values = run_probe(graph, ctx.recipe)
        except Exception as e:
            # Generated probe values can be out of a model's domain (token ids past an embedding). Without an
            # attention mask to classify, the recipe's own first input probes just as well.
            if mask_input_name(graph) is not None:
                raise PassError(ctx.stage_name, f"probe run of the input graph failed: {e}", ctx.done) from e
            feed = dict(next(iter(ctx.feeds)).timing)
            try:
                values = probe_values(graph, feed)
            except Exception as e2:
                raise PassError(ctx.stage_name, f"probe run of the input graph failed: {e2}", ctx.done) from e2
        rctx = RuleContext(target, opset, feed, values)
        available = _rules()
        reports = {}
        for name in cfg.rules:
            reports[name] = available[name](graph, rctx)
            graph.cleanup().toposort()
        model = gs.export_onnx(graph)
        add_contrib_opset(model)
        onnx_io.carry_metadata(source_model, model)
        path = ctx.stage_dir / "model.onnx"
        external = onnx_io.save(model, path)
        out = Artifact("onnx", path, dict(artifact.runtime), {**artifact.meta, "external_data": external})
        check = compare_graphs(artifact, out, ctx)
        worst = min(v["cosine"] for v in check.values()) if check else 1.0
        if worst < cfg.min_cosine:
            raise PassError(
                ctx.stage_name, f"fused graph disagrees with its input: cosine {worst:.7f} < {cfg.min_cosine}", ctx.done
            )
        after = Counter(n.op for n in graph.nodes)
        fused_ops = {
            op: after[op]
            for op in (
                "Attention",
                "SkipLayerNormalization",
                "LayerNormalization",
                "BiasGelu",
                "Gelu",
                "FastGelu",
                "Gemm",
                "FusedConv",
            )
            if after[op] > before.get(op, 0)
        }
        notes = {
            "target": target,
            "fused_ops": fused_ops,
            "rules": {k: r.to_json() for k, r in reports.items()},
            "nodes_before": sum(before.values()),
            "nodes_after": sum(after.values()),
            "check_vs_input": check,
        }
        return PassResult(out, modified=any(r.fused for r in reports.values()), notes=notes)
