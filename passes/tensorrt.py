"""ONNX -> serialized TensorRT engine, for TensorRT 10 and 11.

Precision comes from the graph, never from builder flags: TensorRT 11 removed the FP16/INT8 flags and the INT8
calibrator, and strong typing is always on; on TensorRT 10 the network is created strongly typed, which builds
the same engine. So an FP16 graph (quantize mode fp16) gives an FP16 engine and a QDQ graph (int8_static) an
INT8 one. The engine is built with Polygraphy's loaders and checked against ONNX Runtime on the graph it came
from with Polygraphy's comparator (recorded in engine.json; the budget is judged by the harness). One
optimization profile covers every scenario (min/opt/max from optimizer.runtime.gpu.profiles). The timing cache lives
in the run folder and is reused by later builds. engine.json beside the engine records the TensorRT version,
GPU, compute capability, hardware compatibility, profiles and precision: an engine only runs on the TensorRT
version and GPU family it was built for.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassResult


class TensorRTConfig(PassConfig):
    optimization_level: int = Field(default=3, ge=0, le=5, description="builder optimization level")
    workspace_gb: float = Field(default=4.0, gt=0, description="workspace memory pool limit")
    timing_cache: bool = Field(default=True, description="keep and reuse timing.cache in the run folder")
    hardware_compatibility: Literal["none", "ampere_plus", "same_compute_capability"] = "none"
    tf32: bool = Field(
        default=True,
        description="let FP32 layers compute in TF32 on tensor cores (Ampere and later): TensorRT's own default; "
        "false builds strict FP32 (Polygraphy clears the flag unless asked, so it is set explicitly either way)",
    )
    cross_check: bool = Field(
        default=True, description="check the engine against ONNX Runtime on its source graph (Polygraphy comparator)"
    )


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


class TensorRTPass(Pass[TensorRTConfig]):
    name = "tensorrt"
    summary = "TensorRT engine build (10 and 11; precision from the graph: FP16 or explicit Q/DQ)"
    Config = TensorRTConfig
    consumes = frozenset({"onnx"})
    version = 2  # 2: built through Polygraphy, cross-checked against ONNX Runtime

    @classmethod
    def environment_reason(cls) -> str | None:
        from optimizer.runtime.gpu import tensorrt_reason

        return tensorrt_reason()

    def skip_reason(self, artifact: Artifact, ctx: PassContext) -> str | None:
        reason = super().skip_reason(artifact, ctx)
        if reason is None and ctx.recipe.target.device != "cuda":
            return "target.device is cpu: TensorRT engines run on CUDA devices"
        if reason is None and artifact.path is not None:
            from optimizer.runtime import onnx_io
            from optimizer.runtime.gpu.profiles import asymmetric_qdq_reason

            reason = asymmetric_qdq_reason(onnx_io.load(artifact.path))
        return reason

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        import tensorrt as trt

        from optimizer.runtime import onnx_io
        from optimizer.runtime.gpu import device_summary
        from optimizer.runtime.gpu.profiles import derive_profiles, precision_summary

        cfg = self.config
        assert artifact.path is not None
        graph_only = onnx_io.load(artifact.path, with_weights=False)
        profiles = derive_profiles(input_shapes(graph_only, ctx.recipe), [s.bindings() for s in ctx.recipe.scenarios])
        start = time.perf_counter()
        serialized = build_engine(trt, artifact.path, profiles, cfg, ctx)
        engine_path = ctx.stage_dir / "engine.plan"
        engine_path.write_bytes(bytes(serialized))
        full = onnx_io.load(artifact.path)
        fp16 = sum(1 for t in full.graph.initializer if t.data_type == 10)
        precision = precision_summary(onnx_io.op_histogram(artifact.path), fp16)
        facts = {
            "tensorrt": trt.__version__,
            **device_summary(),
            "build_seconds": time.perf_counter() - start,
            "built_with": "polygraphy loaders",
            "optimization_level": cfg.optimization_level,
            "hardware_compatibility": cfg.hardware_compatibility,
            "strongly_typed": True,
            "tf32": cfg.tf32,  # FP32 layers allowed to compute in TF32
            "profiles": {k: {kk: list(vv) for kk, vv in v.items()} for k, v in profiles.items()},
            "precision": precision,
            "source_graph": artifact.path.name,
        }
        if cfg.cross_check:
            facts["cross_check"] = engine_cross_check(artifact.path, engine_path, ctx, precision)
        (ctx.stage_dir / "engine.json").write_text(json.dumps(facts, indent=2))
        out = artifact.derive(
            kind="trt_engine", path=engine_path, runtime={"cuda_graph": False}, external_data=[], engine=facts
        )
        return PassResult(out, modified=True, notes=facts)


def build_engine(trt: Any, onnx_path: Path, profiles: dict[str, dict[str, tuple[int, ...]]], cfg: TensorRTConfig,
                 ctx: PassContext) -> bytes:
    """The serialized engine, built with Polygraphy's loaders (network from the ONNX file, builder config, engine
    bytes): the same code path `polygraphy convert` takes, kept by NVIDIA across TensorRT majors. Polygraphy's
    log goes to polygraphy.log in the stage folder; a failed parse or build is one PassError quoting its errors."""
    import polygraphy.backend.trt as pg
    from polygraphy.exception import PolygraphyException

    from optimizer.runtime.crosscheck import logged_errors, quiet_polygraphy
    from optimizer.runtime.gpu import tensorrt_major

    profile = pg.Profile()
    for name, shapes in profiles.items():
        profile.add(name, min=shapes["min"], opt=shapes["opt"], max=shapes["max"])
    cache_path = ctx.stage_dir.parent / "timing.cache"
    # TensorRT 11 is always strongly typed (and deprecates the flag); 10 must be asked.
    network = pg.NetworkFromOnnxPath(str(onnx_path), strongly_typed=tensorrt_major() < 11)
    hardware = None
    if cfg.hardware_compatibility != "none":
        hardware = getattr(trt.HardwareCompatibilityLevel, cfg.hardware_compatibility.upper())
    config = pg.CreateConfig(
        profiles=[profile],
        builder_optimization_level=cfg.optimization_level,
        memory_pool_limits={trt.MemoryPoolType.WORKSPACE: int(cfg.workspace_gb * 2**30)},
        hardware_compatibility_level=hardware,
        tf32=cfg.tf32,
        load_timing_cache=str(cache_path) if cfg.timing_cache and cache_path.is_file() else None,
        progress_monitor=progress_monitor(trt, ctx.progress),
    )
    log = ctx.stage_dir / "polygraphy.log"
    try:
        with quiet_polygraphy(log):
            build = pg.EngineBytesFromNetwork(
                network, config=config, save_timing_cache=str(cache_path) if cfg.timing_cache else None
            )
            serialized = build()
    except PolygraphyException as e:
        errors = "; ".join(logged_errors(log)) or str(e)
        raise PassError(f"TensorRT could not build an engine: {errors}") from None
    if not serialized:
        raise PassError(f"TensorRT could not build an engine (see {log})")
    return serialized


# Elementwise tolerances of the cross-runtime check, by the precision the engine runs.
CROSS_CHECK_TOLERANCE = {"fp32": 1e-3, "fp16": 1e-2, "int8": 5e-2}


def engine_cross_check(onnx_path: Path, engine_path: Path, ctx: PassContext, precision: str) -> dict[str, Any]:
    """The engine against ONNX Runtime (CPU) on the graph it was built from, one feed per scenario, with
    Polygraphy's comparator. Recorded, not gated: the accuracy budget is judged by the harness on every stage."""
    from optimizer.runtime.crosscheck import cross_check, onnxruntime_runner, tensorrt_runner

    tolerance = CROSS_CHECK_TOLERANCE[precision.split(" ")[0]]
    feeds = [dict(sf.timing) for sf in ctx.feeds]
    return cross_check(onnxruntime_runner(onnx_path), tensorrt_runner(engine_path), feeds, tolerance, tolerance)
