"""ORT session options as a stage of its own.

ONNX Runtime optimizes every graph it loads (constant folding, its own fusions, layout changes) unless told
not to. If that happened silently in every ONNX stage, ORT's work would be credited to whatever pass came
first. So the export stage is measured with optimizations off, and this stage switches them on: the graph is
the same file, only the session options differ, and the difference in latency is ORT's own.

The graph ORT produces is also saved (ort_optimized.onnx) so its node count shows what ORT fused.
"""

from __future__ import annotations

import shutil
from typing import Literal

from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError, PassError
from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassResult


class OrtSessionConfig(PassConfig):
    graph_optimization_level: Literal["disable_all", "basic", "extended", "all"] = "all"
    execution_mode: Literal["sequential", "parallel"] = "sequential"
    inter_op_threads: int = 1
    save_optimized: bool = True


class OrtSessionPass(Pass):
    name = "ort_session"
    summary = "ONNX Runtime's own graph optimizations, switched on as a stage of their own"
    Config = OrtSessionConfig
    consumes = frozenset({"onnx"})
    requires = ("onnxruntime",)
    handles_generation = True

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        from optimizer.runtime import onnx_io
        from optimizer.runtime.sessions import ort_session
        from optimizer.runtime.threads import target_threads

        cfg: OrtSessionConfig = self.config  # type: ignore[assignment]
        assert artifact.path is not None
        model_path = ctx.stage_dir / "model.onnx"
        # Same graph, new folder: every stage folder holds a complete, deployable artifact.
        for f in artifact.files():
            shutil.copyfile(f, ctx.stage_dir / (model_path.name if f == artifact.path else f.name))
        runtime = {
            "graph_optimization_level": cfg.graph_optimization_level,
            "execution_mode": cfg.execution_mode,
            "inter_op_threads": cfg.inter_op_threads,
        }
        out = artifact.derive(path=model_path, runtime={**artifact.runtime, **runtime})
        notes: dict[str, object] = {"session_options": runtime}
        if cfg.save_optimized:
            optimized = ctx.stage_dir / "ort_optimized.onnx"
            try:
                ort_session(model_path, out.runtime, target_threads(ctx.recipe), optimized_path=str(optimized))
            except OptimizerError as e:
                raise PassError(f"onnxruntime could not optimize the graph: {e}") from e
            hist = onnx_io.op_histogram(optimized)
            notes["ort_optimized_graph"] = {
                "file": optimized.name,
                "nodes": sum(hist.values()),
                "op_types": hist,
            }
        return PassResult(out, modified=cfg.graph_optimization_level != "disable_all", notes=notes)
