"""The `quantize` pass (QuantizePass): runs the mode's driver on one graph, or on both generation graphs and saves
them over one shared weights file, and writes the result through onnx_io with its quantization ops counted in the
notes. The drivers: modes.py (int8_dynamic, int8_static, fp16; the INT8 modes here un-fuse FusedConv and prepare
smoothing or the INT8 attention core first), weight_only.py, and for hybrid hybrid_cpu.py (cpu targets) or
hybrid_gpu.py (cuda, tensorrt). The stage's accuracy is judged by the pipeline against stage 0 on the recipe's
accuracy inputs; the pass itself uses only calibration inputs, which are kept apart from those (calibration.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.pass_base import Pass, PassContext, PassResult
from optimizer.recipe.schema import Recipe
from passes.quantize.config import QuantizeConfig, QuantizeNotes, quantize_bias, symmetric_activations


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

    def recipe_reads(self, recipe: Recipe) -> tuple[str, ...]:
        """The hybrid searches under the recipe's budget (accuracy.min, unless hybrid.min_cosine is set) on its
        metric and output; the CPU hybrid times its ladder and candidates, so its choice holds for those settings
        (the GPU hybrid's choice is untimed)."""
        from optimizer.core.pass_base import TIMING_READS

        cfg = self.config
        if cfg.mode != "hybrid":
            return ()
        budget = ("accuracy.metric", "accuracy.output", *(("accuracy.min",) if cfg.hybrid.min_cosine is None else ()))
        return (*budget, *(TIMING_READS if recipe.target.device == "cpu" else ()))

    def key_extras(self, recipe: Recipe) -> dict[str, Any] | None:
        """INT8 dynamic weights are 7-bit on x86 without VNNI, so the CPU fact is in the key."""
        from optimizer.runtime.cpu_features import int8_reduce_range

        cfg = self.config
        extras: dict[str, Any] = {}
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
        # the quantized graphs are read one at a time while saving (onnx_io.save_shared), from where they were
        # written; the decode part's folder and the prefill's own files go once both are saved
        tmp = ctx.stage_dir / "prefill_part"
        tmp.mkdir()
        for f in p.artifact.files():
            f.rename(tmp / f.name)
        graphs: dict[str, object] = {p.artifact.path.name: tmp / p.artifact.path.name, "decode.onnx": d.artifact.path}
        shared = onnx_io.save_shared(graphs, ctx.stage_dir)
        shutil.rmtree(sub)
        shutil.rmtree(tmp)
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
                from passes.quantize import hybrid_cpu

                notes.update(hybrid_cpu.run(src, dst, artifact, ctx, cfg))
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
                    quantize_bias=quantize_bias(ctx.recipe.target.device),  # cuda: float biases (TensorRT)
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
