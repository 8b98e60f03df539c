"""The `fuse` pass: our own fusion rules over the exported graph, device-aware, numerically checked.

The rules are declared in passes/fuse/rule.py: each names the targets its fused ops run on and the op types it
emits. The driver checks the recipe's target against them once, runs the selected rules that apply in the
configured order (each sees the previous one's output), and reports every rule: what it fused, every place it
looked at and declined with the reason, or why it did not run. The fused graph is then run against its input
graph on every scenario's inputs; below `min_cosine` the stage fails rather than passing a wrong graph on.

Per target: cpu uses ORT contrib kernels (Attention, SkipLayerNormalization, BiasGelu, FastGelu, FusedConv);
cuda the same minus FusedConv (the CUDA EP fuses Conv+activation itself); tensorrt only standard ONNX ops
(LayerNormalization, Gelu at opset >= 20, folded Conv+BN), because TensorRT cannot run com.microsoft ops
and prefers the opset-17 LayerNormalization.

On a generation artifact (prefill + decode graphs with a KV cache) only the rules declared for it run
(kv_attention: attention over the cache -> MultiHeadAttention), and the pair is checked by greedy generation
against its input instead (passes/fuse/generation.py).
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassNotes, PassResult
from passes.fuse.apply import apply_rules, count_fused
from passes.fuse.kernel_choice import KernelChoiceNote
from passes.fuse.rule import FUSED_OPS, RULE_NAMES, RULES, RULES_BY_NAME, FusionRule, RuleReport

if TYPE_CHECKING:
    from optimizer.recipe.schema import Recipe

__all__ = [
    "FUSED_OPS",
    "RULE_NAMES",
    "RULES",
    "RULES_BY_NAME",
    "FuseConfig",
    "FusePass",
    "FusionRule",
    "RuleReport",
    "apply_rules",
    "count_fused",
    "valid_ir_version",
]


class FuseConfig(PassConfig):
    rules: list[Literal[RULE_NAMES]] = Field(default_factory=lambda: list(RULE_NAMES))  # type: ignore[valid-type]
    target: Literal["auto", "cpu", "cuda", "tensorrt"] = Field(default="auto", description="auto: the recipe's device")
    min_cosine: float = Field(default=0.99999, description="reject the fused graph below this cosine vs its input")
    measure: list[Literal[RULE_NAMES]] = Field(  # type: ignore[valid-type]
        default_factory=list,
        description="rules whose fused kernels are measured on a cpu target (ORT's profile of the graph with and "
        "without each, and the two graphs timed interleaved, on the recipe's first scenario): a rule whose kernels "
        "cost more than the ops they replace is left out, and ONNX Runtime's own fusion of the same pattern is then "
        "disabled in the runtime (disabled_optimizers); see passes/fuse/kernel_choice.py",
    )

    @model_validator(mode="after")
    def _measurable(self) -> FuseConfig:
        """Only rules whose ORT counterpart is known can be left out: ORT would make any other fusion again at
        load, and the graph that runs would not be the one measured."""
        can = [r.name for r in RULES if r.ort_fusions]
        for name in self.measure:
            if name not in self.rules:
                raise ValueError(f"measure: {name!r} is not in rules, so there is nothing to measure")
            if name not in can:
                raise ValueError(f"measure: {name!r} cannot be measured (ONNX Runtime's own fusion of it is not "
                                 f"known to be stoppable); measurable rules: {', '.join(can)}")
        return self


class FuseNotes(PassNotes):
    """A fuse stage's notes. Typed: what the report reads back (each measured rule's kernel choice: a rule left
    out is a finding) and the fused op counts; the rest (per-rule reports, the check against the input, IR
    version, the generation graphs') as written."""

    fused_ops: dict[str, int] | None = None  # fused op type -> nodes it made
    kernel_choice: dict[str, KernelChoiceNote] | None = None  # rule -> its measurement (fuse's `measure`)


# IR version 4 (ONNX 1.4, with opset 9) is the first where an initializer need not also be a graph input.
IR_INITIALIZERS_APART = 4


def valid_ir_version(model: Any) -> int:
    """Raise an exported model's IR version to 4 where its initializers are not all graph inputs; returns it.

    Old exporters wrote IR version 3 with every weight listed as a graph input too. GraphSurgeon reads those
    inputs as constants and writes them back as initializers only, which IR 3 forbids: onnx.checker refuses the
    graph and ORT's quantizer does not find the weights ("Input ... is undefined"). IR 4 reads the same graph
    with the weights as constants, which is what they are (and what lets ORT fold them)."""
    inputs = {i.name for i in model.graph.input}
    if model.ir_version < IR_INITIALIZERS_APART and any(t.name not in inputs for t in model.graph.initializer):
        model.ir_version = IR_INITIALIZERS_APART
    return int(model.ir_version)


class FusePass(Pass[FuseConfig]):
    name = "fuse"
    summary = "our fusion rules: attention+QKV merge, LayerNorm/SkipLayerNorm, GELU/BiasGelu, Gemm, Conv+BN/act"
    Config = FuseConfig
    Notes = FuseNotes
    consumes = frozenset({"onnx"})
    # 2: an IR-3 input's fused graph is written at IR 4 (valid without its weights as inputs); 3: kernel choice;
    # 4: generation artifacts (kv_attention)
    version = 4
    requires = ("onnx_graphsurgeon", "onnxruntime")
    handles_generation = True  # the rules declared for KV-cache graphs (passes/fuse/generation.py)

    def recipe_reads(self, recipe: Recipe) -> tuple[str, ...]:
        """A kernel choice holds for the threads and benchmark settings it was measured with."""
        from optimizer.core.pass_base import TIMING_READS

        return TIMING_READS if self.config.measure else ()

    def skip_reason(self, artifact: Artifact, ctx: PassContext) -> str | None:
        reason = super().skip_reason(artifact, ctx)
        if reason is not None or not artifact.decode:
            return reason
        cfg = self.config
        target = ctx.recipe.target.device if cfg.target == "auto" else cfg.target
        if not any(RULES_BY_NAME[r].generation and RULES_BY_NAME[r].runs_on(target) for r in cfg.rules):
            able = [f"{r.name} ({'/'.join(sorted(r.targets))})" for r in RULES if r.generation]
            return f"no rule in rules fuses generation graphs on target {target}; those that do: {', '.join(able)}"
        return None

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        import onnx_graphsurgeon as gs

        from optimizer.runtime import onnx_io
        from passes.fuse.check import compare_graphs
        from passes.fuse.context import RuleContext
        from passes.fuse.graph import name_nodes
        from passes.fuse.kernel_choice import KernelChoice, choose_kernels
        from passes.fuse.probe import add_contrib_opset, mask_input_name, probe_values, run_probe

        cfg = self.config
        target = ctx.recipe.target.device if cfg.target == "auto" else cfg.target
        if artifact.decode:
            from passes.fuse.generation import fuse_generation

            return fuse_generation(artifact, ctx, list(cfg.rules), cfg.min_cosine, target)
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
                raise PassError(f"probe run of the input graph failed: {e}") from e
            feed = dict(next(iter(ctx.feeds)).timing)
            try:
                values = probe_values(graph, feed)
            except Exception as e2:
                raise PassError(f"probe run of the input graph failed: {e2}") from e2
        rctx = RuleContext(target, opset, feed, values)

        made: dict[Path, tuple[dict[str, RuleReport], Counter[str], int]] = {}  # model path -> its build's account

        def build(rules: list[str], folder: Path) -> Artifact:
            graph = gs.import_onnx(source_model)
            name_nodes(graph)
            reports = apply_rules(graph, rules, rctx)
            model = gs.export_onnx(graph)
            add_contrib_opset(model)
            ir_version = valid_ir_version(model)
            onnx_io.carry_metadata(source_model, model)
            folder.mkdir(parents=True, exist_ok=True)
            external = onnx_io.save(model, folder / "model.onnx")
            out = artifact.derive(path=folder / "model.onnx", external_data=external)
            made[out.path] = (reports, Counter(n.op for n in graph.nodes), ir_version)
            return out

        # Rules for generation artifacts (KV cache) do not run on a single graph: their check is a generation.
        single = [r for r in cfg.rules if not RULES_BY_NAME[r].generation]
        out = build(single, ctx.stage_dir)
        choices: list[KernelChoice] = []
        device = ctx.recipe.target.device
        if cfg.measure and device == "cpu":
            trials = ctx.stage_dir / "kernel_choice"
            fused = {k: r.fused for k, r in made[out.path][0].items()}
            chosen, choices = choose_kernels(
                single, list(cfg.measure), fused, out, lambda rules, name: build(rules, trials / name), ctx
            )
            if chosen is not out:  # the timed trial graph becomes the stage's, with the runtime it was timed on
                for old in out.files():
                    old.unlink()
                for f in chosen.files():
                    shutil.move(f, ctx.stage_dir / f.name)
                made[ctx.stage_dir / "model.onnx"] = made[chosen.path]
                out = chosen.derive(path=ctx.stage_dir / "model.onnx")
            shutil.rmtree(trials, ignore_errors=True)
        reports, after, ir_version = made[out.path]
        for c in choices:
            if not c.kept:
                reports[c.rule] = RuleReport(skipped=c.line())
        for r in cfg.rules:
            if RULES_BY_NAME[r].generation:
                reports[r] = RuleReport(skipped=f"{r}: runs on generation artifacts (prefill + decode graphs) only")
        check = compare_graphs(artifact, out, ctx)
        worst = min(v["cosine"] for v in check.values()) if check else 1.0
        if worst < cfg.min_cosine:
            raise PassError(f"fused graph disagrees with its input: cosine {worst:.7f} < {cfg.min_cosine}")
        notes = {
            "target": target,
            "fused_ops": count_fused(before, after),
            "rules": {k: reports[k].to_json() for k in cfg.rules if k in reports},
            "nodes_before": sum(before.values()),
            "nodes_after": sum(after.values()),
            "check_vs_input": check,
        }
        if choices:
            notes["kernel_choice"] = {c.rule: c.note() for c in choices}
        elif cfg.measure and device != "cpu":  # the timing and the profile would not run on the target
            notes["kernel_choice_skipped"] = f"measured on a cpu target only (this one is {device}): every rule kept"
        if ir_version != source_model.ir_version:
            notes["ir_version"] = {"input": source_model.ir_version, "output": ir_version}
        return PassResult(out, modified=any(r.fused for r in reports.values()), notes=FuseNotes.model_validate(notes))
