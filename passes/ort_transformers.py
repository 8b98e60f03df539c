"""ONNX Runtime's transformers optimizer (what Olive and Optimum use), as a stage of its own.

Kept beside our `fuse` pass so the two can be compared stage by stage on the same parent. It matches
patterns of older exporters; on graphs from torch.onnx's dynamo exporter it finds fewer fusions (its
statistics are in the stage notes, so the difference is visible).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassResult
from optimizer.core.quiet import quiet


class OrtTransformersConfig(PassConfig):
    model_type: Literal["bert", "gpt2", "bart", "t5", "vit", "clip"] = "bert"
    num_heads: int = Field(default=0, ge=0, description="0: detect from the graph")
    hidden_size: int = Field(default=0, ge=0, description="0: detect from the graph")
    opt_level: Literal[0, 1, 2, 99] | None = Field(default=None, description="ORT level run inside; None: its default")


class OrtTransformersPass(Pass[OrtTransformersConfig]):
    name = "ort_transformers"
    summary = "onnxruntime.transformers.optimizer (ORT's own fusion tool), for comparison with `fuse`"
    Config = OrtTransformersConfig
    consumes = frozenset({"onnx"})
    requires = ("onnxruntime",)

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        from onnxruntime.transformers.optimizer import optimize_model

        from optimizer.runtime import onnx_io

        cfg = self.config
        assert artifact.path is not None
        try:
            with quiet() as log:
                optimized = optimize_model(
                    str(artifact.path),
                    model_type=cfg.model_type,
                    num_heads=cfg.num_heads,
                    hidden_size=cfg.hidden_size,
                    opt_level=cfg.opt_level,
                    use_gpu=ctx.recipe.target.device == "cuda",
                )
                stats = optimized.get_fused_operator_statistics()
        except Exception as e:
            raise PassError(f"onnxruntime.transformers.optimizer failed: {e}") from e
        path = ctx.stage_dir / "model.onnx"
        external = onnx_io.save(optimized.model, path)
        out = artifact.derive(path=path, external_data=external)
        fused = {k: v for k, v in stats.items() if v}
        return PassResult(out, modified=bool(fused), notes={"fused_ops": fused, "log": log.getvalue()[-4000:]})
