"""The `quantize` pass: int8_dynamic, int8_static (QDQ), fp16, and hybrid under an accuracy budget.

See modes.py for the plain modes and hybrid.py for the per-node search. The stage's accuracy is judged by
the pipeline against stage 0 on the recipe's accuracy inputs; the pass itself only uses calibration inputs,
which are kept apart from those (calibration.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassNotes, PassResult
from optimizer.recipe.schema import Recipe, recipe_metric
from passes.quantize.modes import DEFAULT_OPS
from passes.quantize.weight_only import WeightOnlySettings


class CalibrationConfig(PassConfig):
    method: Literal["minmax", "entropy", "percentile"] = "minmax"
    samples: int = Field(default=16, ge=1, description="calibration inputs (text from the end of the file)")
    percentile: float = Field(default=99.999, gt=50, le=100)


class HybridSettings(PassConfig):
    min_cosine: float | None = Field(default=None, description="default: the recipe's accuracy budget (cosine)")
    margin: float = Field(default=0.003, ge=0, description="head-room kept on the search inputs")
    choose: Literal["fastest", "most_int8"] = Field(
        default="fastest",
        description="fastest: time a ladder of INT8 sets against FP32 with the harness and keep the fewest INT8 "
        "nodes within speed_tolerance of the fastest; most_int8: the largest set within budget, untimed",
    )
    speed_tolerance: float = Field(default=0.03, ge=0, lt=1, description="speed given up for fewer INT8 nodes")
    candidates: list[Literal["static", "attention_core"]] = Field(
        default_factory=list,
        description="forms of the chosen INT8 set also tried, each kept only if within budget and faster (timed "
        "head to head against the set): static = calibrated QDQ activations for its MatMuls (variants.py); "
        "attention_core = QK^T and probabilities x V in INT8 too (attention.py); each a line in hybrid_search.json",
    )


class SmoothSettings(PassConfig):
    """SmoothQuant-style activation smoothing before INT8 (smooth.py): exact in FP32, fewer outlier channels."""

    alpha: float = Field(default=0.7, ge=0, le=1, description="migration strength: s = max|X|^a / max|W|^(1-a)")
    nodes: list[str] = Field(
        default_factory=list, description="MatMul / Attention nodes to smooth; empty: every node the mode may quantize"
    )


class QuantizeConfig(PassConfig):
    mode: Literal["int8_dynamic", "int8_static", "fp16", "hybrid", "weight_only"]
    per_channel: bool = True
    symmetric_activations: bool | None = Field(
        default=None,
        description="signed INT8 activations with zero point 0; default: on for cuda targets (TensorRT takes only "
        "symmetric Q/DQ), off on the CPU (asymmetric uint8 keeps more of a ReLU's range)",
    )
    op_types: list[str] = Field(default_factory=lambda: list(DEFAULT_OPS))
    exclude_nodes: list[str] = Field(default_factory=list)
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)
    keep_io_types: bool = True
    op_block_list: list[str] = Field(default_factory=list, description="fp16: op types kept in FP32")
    node_block_list: list[str] = Field(default_factory=list, description="fp16: nodes kept in FP32")
    hybrid: HybridSettings = Field(default_factory=HybridSettings)
    smooth: SmoothSettings | None = Field(
        default=None, description="int8_dynamic, int8_static, hybrid: smooth activations into weights first"
    )
    attention_core: Literal["fp32", "int8"] = Field(
        default="fp32",
        description="int8_dynamic: fp32 keeps ORT's fused attention (QAttention: the QKV projection in INT8); int8 "
        "writes com.microsoft Attention back as MatMuls and quantizes QK^T and probabilities x V too",
    )
    weight_only: WeightOnlySettings = Field(
        default_factory=WeightOnlySettings, description="weight_only: MatMul weights in 4 or 8 bits (MatMulNBits)"
    )

    @model_validator(mode="after")
    def _options_of_the_mode(self) -> QuantizeConfig:
        if self.smooth is not None and self.mode not in ("int8_dynamic", "int8_static", "hybrid"):
            raise ValueError(f"smooth applies to int8_dynamic, int8_static and hybrid, not {self.mode}")
        if self.attention_core == "int8" and self.mode != "int8_dynamic":
            raise ValueError(f"attention_core: int8 applies to int8_dynamic (hybrid: candidates), not {self.mode}")
        return self


class QuantizeNotes(PassNotes):
    """A quantize stage's notes. Typed: what a bundle's manifest reads back (deploy.bundle: the precision of the
    stage); the rest of the account (calibration, reduce_range, the hybrid search, smoothing, check...) as the mode
    wrote it. A generation artifact's are per graph (`prefill`, `decode`)."""

    mode: str | None = None  # QuantizeConfig.mode
    int8_nodes: list[str] | None = None  # hybrid: the nodes chosen for INT8
    quantization_ops: dict[str, int] | None = None  # quantization op types in the graph written, counted
    prefill: QuantizeNotes | None = None
    decode: QuantizeNotes | None = None


def symmetric_activations(cfg: QuantizeConfig, device: str) -> bool:
    """Signed, zero-point-0 activations: asked for, or by default on cuda targets (what TensorRT takes)."""
    return cfg.symmetric_activations if cfg.symmetric_activations is not None else device == "cuda"


class QuantizePass(Pass[QuantizeConfig]):
    name = "quantize"
    summary = (
        "INT8 (dynamic, static QDQ), FP16, weight-only INT4/INT8 (MatMulNBits), and hybrid INT8/FP32 chosen per "
        "node under the accuracy budget"
    )
    Config = QuantizeConfig
    Notes = QuantizeNotes
    consumes = frozenset({"onnx"})
    # 2: generation graphs share one weights file; 3: hybrid judged on kept positions, timed by the harness;
    # 4: INT8 modes un-fuse FusedConv first (Conv + Add + activation), so fused CNNs get INT8 convolutions
    version = 4
    requires = ("onnxruntime",)
    handles_generation = True

    def key_extras(self, recipe: Recipe) -> dict[str, Any] | None:
        """The CPU hybrid times its ladder and candidates: its choice holds for those settings (the GPU hybrid's
        choice is untimed); INT8 dynamic weights are 7-bit on x86 without VNNI, so the CPU fact is in the key."""
        from optimizer.core.pass_base import timing_key
        from optimizer.runtime.cpu_features import int8_reduce_range

        cfg = self.config
        extras = dict(timing_key(recipe)) if cfg.mode == "hybrid" and recipe.target.device == "cpu" else {}
        if cfg.mode in ("int8_dynamic", "hybrid") and int8_reduce_range()[0]:
            extras["int8_reduce_range"] = True  # 7-bit weights on this CPU: not the artifact a VNNI machine builds
        return extras or None

    def skip_reason(self, artifact: Artifact, ctx: PassContext) -> str | None:
        cfg = self.config
        if artifact.decode and cfg.mode not in ("int8_dynamic", "fp16", "weight_only"):
            return f"{cfg.mode} on generation graphs is not supported yet (int8_dynamic, fp16 and weight_only are)"
        return super().skip_reason(artifact, ctx) or self._nothing_to_quantize(artifact)

    def _nothing_to_quantize(self, artifact: Artifact) -> str | None:
        """An INT8 mode that would quantize no node is a skip with the reason, not a stage that "ran" and wrote
        its input back (e.g. dynamic INT8 of MatMuls whose weights a node computes)."""
        from optimizer.runtime import onnx_io
        from passes.quantize import modes

        cfg = self.config
        if cfg.mode not in ("int8_static", "int8_dynamic") or artifact.decode or artifact.path is None:
            return None
        model = onnx_io.load(artifact.path, with_weights=False)
        reason = modes.nothing_to_quantize(model, cfg.mode, cfg.op_types, cfg.exclude_nodes)
        return f"{cfg.mode}: nothing to quantize: {reason}" if reason else None

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        result = self._run_generation(artifact, ctx) if artifact.decode else self._run_one(artifact, ctx)
        if self.config.mode == "weight_only":
            from passes.quantize.weight_only import check_against_input

            check = check_against_input(artifact, result.artifact, ctx)
            return PassResult(result.artifact, result.modified,
                              QuantizeNotes.model_validate({**result.notes_json(), "check": check}))
        return result

    def _run_generation(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        """Both generation graphs, the same mode each (the decode graph in a sub-folder first), then saved over
        one shared weights file, as export wrote them."""
        import shutil

        from optimizer.runtime import onnx_io

        decode = artifact.decode_path()
        assert decode is not None and artifact.path is not None
        sub = ctx.stage_dir / "decode_part"
        sub.mkdir()
        part = ctx.fork(sub)
        single = artifact.derive(decode=None, decode_external_data=[])
        d = self._run_one(single.derive(path=decode), part)
        p = self._run_one(single, ctx)
        assert d.artifact.path is not None and p.artifact.path is not None
        graphs = {p.artifact.path.name: onnx_io.load(p.artifact.path), "decode.onnx": onnx_io.load(d.artifact.path)}
        shutil.rmtree(sub)
        for f in p.artifact.files():
            f.unlink()
        shared = onnx_io.save_shared(graphs, ctx.stage_dir)
        out = p.artifact.derive(
            external_data=shared, decode="decode.onnx", layers=artifact.layers, decode_external_data=[]
        )
        notes = QuantizeNotes(prefill=QuantizeNotes.model_validate(p.notes_json()),
                              decode=QuantizeNotes.model_validate(d.notes_json()))
        return PassResult(out, modified=True, notes=notes)

    def _run_one(self, artifact: Artifact, ctx: PassContext) -> PassResult:

        from optimizer.runtime import onnx_io
        from passes.quantize import modes

        cfg = self.config
        assert artifact.path is not None
        src = self._named_input(artifact, ctx)
        dst = ctx.stage_dir / "model.onnx"
        notes: dict[str, object] = {"mode": cfg.mode}
        progress = ctx.progress
        try:
            if cfg.mode in ("int8_dynamic", "int8_static"):
                notes.update(self._int8(src, dst, ctx, cfg, artifact.runtime))
            elif cfg.mode == "fp16":
                model = modes.fp16(onnx_io.load(src), cfg.keep_io_types, cfg.op_block_list, cfg.node_block_list)
                onnx_io.save(model, dst)
            elif cfg.mode == "weight_only":
                from passes.quantize import weight_only

                notes.update(weight_only.quantize(src, dst, cfg.weight_only, cfg.exclude_nodes))
            elif ctx.recipe.target.device != "cpu":  # INT8 / FP16 / FP32 per node, simulated on the CPU
                from passes.quantize import hybrid_gpu

                notes.update(hybrid_gpu.run(src, dst, artifact, ctx, cfg))
            else:
                notes.update(self._hybrid(src, dst, artifact, ctx, cfg, progress))
        except PassError:
            raise
        except Exception as e:
            raise PassError(f"{cfg.mode} quantization failed: {e}") from e
        finally:
            if src != artifact.path:
                src.unlink(missing_ok=True)
        model = onnx_io.load(dst, with_weights=False)
        counts: dict[str, int] = {}
        for node in model.graph.node:
            if node.op_type in (
                "DynamicQuantizeLinear",
                "QuantizeLinear",
                "QAttention",
                "MatMulInteger",
                "DynamicQuantizeMatMul",
                "Cast",
            ):
                counts[node.op_type] = counts.get(node.op_type, 0) + 1
        notes["quantization_ops"] = counts
        # Re-save through the one helper, so every stage follows the same external-data policy.
        full = onnx_io.load(dst)
        referenced = [dst.parent / f for f in onnx_io.external_data_files(dst)]  # e.g. a source's, copied along
        for leftover in {*ctx.stage_dir.glob("*.data"), *referenced}:
            leftover.unlink()
        external = onnx_io.save(full, dst)
        out = artifact.derive(path=dst, external_data=external)
        return PassResult(out, modified=True, notes=QuantizeNotes.model_validate(notes))

    def _int8(
        self, src: Path, dst: Path, ctx: PassContext, cfg: QuantizeConfig, runtime: dict | None = None
    ) -> dict[str, object]:
        """int8_dynamic or int8_static of `src` into `dst`, FusedConv nodes un-fused first (modes.unfuse_convs);
        a result with no quantized tensor is a failure, not a stage that ran."""
        from optimizer.runtime import onnx_io
        from passes.quantize import modes
        from passes.quantize.calibration import FeedReader, calibration_feeds
        from passes.quantize.variants import preprocess

        work = ctx.stage_dir / "input_int8.onnx"
        # Smoothing (cfg.smooth) and the INT8 attention core (cfg.attention_core) rewrite the FP32 graph first.
        prepared = ctx.stage_dir / "input_prepared.onnx"
        src, notes, core = preprocess(src, prepared, cfg, ctx, runtime or {})
        per_channel_qdq = cfg.per_channel and cfg.mode == "int8_static"
        with modes.quantizer_input(src, work, cfg.op_types, per_channel_qdq) as (plain, unfused):
            if unfused.convs:
                notes["unfused_convs"] = len(unfused.convs)
            if unfused.kept:
                notes["kept_fused"] = unfused.kept  # an activation with no standard op: stays FusedConv, FP32
            if cfg.mode == "int8_dynamic":
                from optimizer.runtime.cpu_features import int8_reduce_range

                reduce, why = int8_reduce_range()
                notes["reduce_range"] = {"on": reduce, "why": why}
            if cfg.mode == "int8_dynamic" and core:
                graph = onnx_io.load(plain, with_weights=False)
                ops = sorted({*cfg.op_types, "MatMul"})
                wanted = [n for n in modes.quantizable_nodes(graph, ops) if n not in cfg.exclude_nodes] + core
                modes.int8_dynamic(plain, dst, cfg.per_channel, ops, wanted, cfg.exclude_nodes, const_b_only=False)
            elif cfg.mode == "int8_dynamic":
                modes.int8_dynamic(plain, dst, cfg.per_channel, cfg.op_types, None, cfg.exclude_nodes)
            else:
                feeds, info = calibration_feeds(ctx.recipe, cfg.calibration.samples, ctx.progress, all_scenarios=False)
                notes["calibration"] = {**info, "method": cfg.calibration.method}
                modes.int8_static(
                    plain,
                    dst,
                    FeedReader(feeds, ctx.feeds.input_names),
                    cfg.calibration.method,
                    cfg.per_channel,
                    symmetric_activations(cfg, ctx.recipe.target.device),
                    # The un-fused Add/activation nodes too: quantized, each group runs as one QLinearConv
                    # (+ QLinearAdd), the INT8 form of the fused op; other nodes of those types stay as asked.
                    [*cfg.op_types, *unfused.extra_ops],
                    [*cfg.exclude_nodes, *unfused.extra_exclude],
                    cfg.calibration.percentile,
                )
            before = modes.quantized_op_count(onnx_io.load(plain, with_weights=False))
        for f in ctx.stage_dir.glob(prepared.name + "*"):
            f.unlink()
        if modes.quantized_op_count(onnx_io.load(dst, with_weights=False)) <= before:
            raise PassError(
                f"{cfg.mode} quantized nothing: ORT's quantizer wrote no quantized node for op_types {cfg.op_types}"
            )
        return notes

    def _named_input(self, artifact: Artifact, ctx: PassContext):  # type: ignore[no-untyped-def]
        """ORT's quantizer picks nodes by name: give unnamed nodes names (in a temporary copy) if needed."""
        from optimizer.runtime import onnx_io

        assert artifact.path is not None
        model = onnx_io.load(artifact.path, with_weights=False)
        if all(n.name for n in model.graph.node):
            return artifact.path
        model = onnx_io.load(artifact.path)
        for i, node in enumerate(model.graph.node):
            node.name = node.name or f"{node.op_type}_{i}"
        path = ctx.stage_dir / "input_named.onnx"
        onnx_io.save(model, path)
        return path

    def _hybrid(self, src, dst, artifact, ctx, cfg, progress) -> dict[str, object]:  # type: ignore[no-untyped-def]
        from optimizer.runtime import onnx_io
        from optimizer.runtime.cpu_features import int8_reduce_range
        from passes.quantize import hybrid, modes
        from passes.quantize.calibration import calibration_feeds

        budget = cfg.hybrid.min_cosine
        metric = recipe_metric(ctx.recipe)
        if metric not in ("cosine", "pooled_cosine"):
            metric = "cosine"
        if budget is None:
            acc = ctx.recipe.accuracy
            budget = acc.min if recipe_metric(ctx.recipe) in ("cosine", "pooled_cosine") and acc.min else 0.99
        feeds, info = calibration_feeds(ctx.recipe, cfg.calibration.samples, progress)
        # Candidates are timed on the first scenario's calibration inputs (the shape "best" leads with).
        n_scen = len(ctx.recipe.scenarios)
        timing_feeds = [f for i, f in enumerate(feeds) if i % n_scen == 0]
        graph_only = onnx_io.load(src, with_weights=False)
        scopes = onnx_io.node_scopes(graph_only)
        nodes = [n for n in modes.quantizable_nodes(graph_only, cfg.op_types) if n not in cfg.exclude_nodes]
        evaluator = hybrid.Evaluator(src, feeds, timing_feeds, ctx, artifact.runtime, metric)
        state = hybrid.Search(
            budget=budget,
            margin=cfg.hybrid.margin,
            choose=cfg.hybrid.choose,
            speed_tolerance=cfg.hybrid.speed_tolerance,
        )
        work = ctx.stage_dir / "search"
        work.mkdir()
        chosen = hybrid.search(src, work, nodes, evaluator, state, cfg.per_channel, cfg.op_types, progress)
        techniques: list[dict[str, object]] = []
        form = "dynamic"
        if cfg.smooth is not None or cfg.hybrid.candidates:
            from passes.quantize import variants

            start = variants.Choice(work / "chosen.onnx" if chosen else src, src, chosen)
            start.cosine = next((p["cosine"] for p in state.points if p["int8_nodes"] == len(chosen)), 1.0)
            final, techniques = variants.improve(start, nodes, evaluator, state, cfg, feeds, work, ctx, progress)
            variants.write(final, src, dst)
            chosen, form = final.int8, final.form
        elif chosen:
            shutil.copyfile(work / "chosen.onnx", dst)
        else:
            onnx_io.copy_model(src, dst)  # with its external data: an ONNX source keeps its weights beside it
        shutil.rmtree(work)
        table = sorted(
            (
                {
                    "node": n,
                    "module": scopes.get(n, "?"),
                    "sensitivity": s,
                    "precision": "int8" if n in chosen else "fp32",
                }
                for n, s in state.sensitivity.items()
            ),
            key=lambda r: -r["sensitivity"],
        )
        (ctx.stage_dir / "sensitivity.json").write_text(json.dumps(table, indent=1))
        search_record = {
            "metric": f"{metric} on kept positions, worst calibration sample",
            "budget": budget,
            "margin": cfg.hybrid.margin,
            "accuracy_points": state.points,
            "timings": state.timings,  # each set vs the FP32 input, interleaved: speedup, 95% interval, P50s
            "decision": state.decision,
            # smoothing, static activations, INT8 attention core: one line each, its accuracy, speed and gain
            "techniques": techniques,
            "form": form,
        }
        (ctx.stage_dir / "hybrid_search.json").write_text(json.dumps(search_record, indent=1))
        verdict = (
            f"{len(chosen)} of {len(nodes)} nodes INT8, the rest FP32 ({state.decision})"
            if chosen
            else f"no INT8 set met {metric} >= {budget} + margin {cfg.hybrid.margin}: every node kept in FP32"
        )
        return {
            "budget_cosine": budget,
            "margin": cfg.hybrid.margin,
            "calibration": info,
            "decision": verdict,
            "int8_nodes": chosen,
            "fp32_nodes": [n for n in nodes if n not in chosen],
            "most_sensitive": table[:5],
            "search_points": state.points,
            "timings": state.timings,
            "form": form,
            "techniques": [
                {k: t[k] for k in ("technique", "kept", "why", "int8_nodes", "gain") if k in t} for t in techniques
            ],
            "files": ["sensitivity.json", "hybrid_search.json"],
            "reduce_range": dict(zip(("on", "why"), int8_reduce_range(), strict=True)),
        }
