"""ONNX -> serialized TensorRT engine, for TensorRT 10 and 11.

Precision comes from the graph, never from builder flags: TensorRT 11 removed the FP16/INT8 flags and the INT8
calibrator, and strong typing is always on; on TensorRT 10 the network is created strongly typed, which builds
the same engine. So an FP16 graph (quantize mode fp16) gives an FP16 engine and a QDQ graph (int8_static) an
INT8 one. One optimization profile covers every scenario (min/opt/max from optimizer.gpu.profiles). The timing
cache lives in the run folder and is reused by later builds. engine.json beside the engine records the
TensorRT version, GPU, compute capability, hardware compatibility, profiles and precision: an engine only runs
on the TensorRT version and GPU family it was built for.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import Field

from optimizer.artifact import Artifact
from optimizer.errors import PassError
from optimizer.pass_base import Pass, PassConfig, PassContext, PassResult


class TensorRTConfig(PassConfig):
    optimization_level: int = Field(default=3, ge=0, le=5, description="builder optimization level")
    workspace_gb: float = Field(default=4.0, gt=0, description="workspace memory pool limit")
    timing_cache: bool = Field(default=True, description="keep and reuse timing.cache in the run folder")
    hardware_compatibility: Literal["none", "ampere_plus", "same_compute_capability"] = "none"


def input_shapes(model: Any, recipe: Any) -> dict[str, list[int | str]]:
    """Each graph input's dims: the recipe's symbolic names where it has them, else the graph's own dims."""
    specs = {s.name: s for s in recipe.inputs}
    inits = {t.name for t in model.graph.initializer}
    out: dict[str, list[int | str]] = {}
    for v in model.graph.input:
        if v.name in inits:
            continue
        if v.name in specs:
            out[v.name] = list(specs[v.name].shape)
        else:
            out[v.name] = [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
    return out


def progress_monitor(trt: Any, report: Any) -> Any:
    """TensorRT's IProgressMonitor, forwarded to the pipeline's progress line."""

    class Monitor(trt.IProgressMonitor):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.phases: dict[str, int] = {}

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            self.phases[phase_name] = num_steps
            report(f"TensorRT: {phase_name}", 0, num_steps)

        def step_complete(self, phase_name: str, step: int) -> bool:
            report(f"TensorRT: {phase_name}", step + 1, self.phases.get(phase_name, 0))
            return True  # False would cancel the build

        def phase_finish(self, phase_name: str) -> None:
            self.phases.pop(phase_name, None)

    return Monitor()


class TensorRTPass(Pass):
    name = "tensorrt"
    summary = "TensorRT engine build (10 and 11; precision from the graph: FP16 or explicit Q/DQ)"
    Config = TensorRTConfig
    consumes = frozenset({"onnx"})

    @classmethod
    def environment_reason(cls) -> str | None:
        from optimizer.gpu import tensorrt_reason

        return tensorrt_reason()

    def skip_reason(self, artifact: Artifact, ctx: PassContext) -> str | None:
        reason = super().skip_reason(artifact, ctx)
        if reason is None and ctx.recipe.target.device != "cuda":
            return "target.device is cpu: TensorRT engines run on CUDA devices"
        if reason is None and artifact.path is not None:
            from optimizer import onnx_io
            from optimizer.gpu.profiles import asymmetric_qdq_reason

            reason = asymmetric_qdq_reason(onnx_io.load(artifact.path))
        return reason

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        import tensorrt as trt

        from optimizer import onnx_io
        from optimizer.gpu import device_summary, tensorrt_major
        from optimizer.gpu.profiles import derive_profiles, precision_summary

        cfg: TensorRTConfig = self.config  # type: ignore[assignment]
        assert artifact.path is not None
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        flags = 0
        if tensorrt_major() < 11:  # 11 is always strongly typed; 10 must be asked
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(artifact.path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise PassError(ctx.stage_name, f"TensorRT's ONNX parser rejected the graph: {errors}", ctx.done)
        config = builder.create_builder_config()
        config.builder_optimization_level = cfg.optimization_level
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(cfg.workspace_gb * 2**30))
        if cfg.hardware_compatibility != "none":
            config.hardware_compatibility_level = getattr(
                trt.HardwareCompatibilityLevel, cfg.hardware_compatibility.upper()
            )
        config.progress_monitor = progress_monitor(trt, ctx.progress)
        graph_only = onnx_io.load(artifact.path, with_weights=False)
        profiles = derive_profiles(input_shapes(graph_only, ctx.recipe), [s.bindings() for s in ctx.recipe.scenarios])
        profile = builder.create_optimization_profile()
        for name, shapes in profiles.items():
            profile.set_shape(name, shapes["min"], shapes["opt"], shapes["max"])
        config.add_optimization_profile(profile)
        cache_path = ctx.stage_dir.parent / "timing.cache"
        cache = config.create_timing_cache(
            cache_path.read_bytes() if cfg.timing_cache and cache_path.is_file() else b""
        )
        config.set_timing_cache(cache, ignore_mismatch=False)
        start = time.perf_counter()
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise PassError(ctx.stage_name, "TensorRT could not build an engine (see its log above)", ctx.done)
        engine_path = ctx.stage_dir / "engine.plan"
        engine_path.write_bytes(bytes(serialized))
        if cfg.timing_cache:
            cache_path.write_bytes(bytes(config.get_timing_cache().serialize()))
        full = onnx_io.load(artifact.path)
        fp16 = sum(1 for t in full.graph.initializer if t.data_type == 10)
        meta = {
            "tensorrt": trt.__version__,
            **device_summary(),
            "build_seconds": time.perf_counter() - start,
            "optimization_level": cfg.optimization_level,
            "hardware_compatibility": cfg.hardware_compatibility,
            "strongly_typed": True,
            "profiles": {k: {kk: list(vv) for kk, vv in v.items()} for k, v in profiles.items()},
            "precision": precision_summary(onnx_io.op_histogram(artifact.path), fp16),
            "source_graph": artifact.path.name,
        }
        (ctx.stage_dir / "engine.json").write_text(json.dumps(meta, indent=2))
        out = Artifact("trt_engine", engine_path, {"cuda_graph": False}, {**artifact.meta, "engine": meta})
        return PassResult(out, modified=True, notes=meta)
