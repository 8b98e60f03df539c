"""Runners load an artifact with its runtime options and run it. One per runtime; imported lazily."""

from __future__ import annotations

from typing import TYPE_CHECKING

from optimizer.core.artifact import Artifact

if TYPE_CHECKING:
    from optimizer.recipe.schema import Recipe
    from optimizer.runtime.runners.base import Runner


def runner_for(artifact: Artifact, recipe: Recipe, device: str | None = None) -> Runner:
    """The runner of the artifact's kind. device: None = the recipe's target; passes check on "cpu"."""
    if artifact.kind == "torch":
        from optimizer.runtime.runners.torch_runner import TorchRunner

        return TorchRunner(artifact, recipe, device)
    if artifact.kind == "onnx":
        from optimizer.runtime.runners.ort_runner import OrtRunner

        return OrtRunner(artifact, recipe, device)
    if artifact.kind == "trt_engine":
        from optimizer.runtime.runners.trt_runner import TrtRunner

        return TrtRunner(artifact, recipe)
    if artifact.kind == "openvino":
        from optimizer.runtime.runners.ov_runner import OvRunner

        return OvRunner(artifact, recipe, device)
    raise NotImplementedError(f"no runner for {artifact.kind} artifacts")


def runner_reason(artifact: Artifact, recipe: Recipe) -> str | None:
    """Why this artifact cannot be run (so measured) on the recipe's target here, or None."""
    from optimizer.runtime import gpu

    if artifact.kind == "trt_engine":
        return gpu.tensorrt_reason()
    if artifact.kind == "openvino":
        from optimizer.runtime.ov_engine import openvino_reason

        reason = openvino_reason()
        return reason or ("OpenVINO stages run on the CPU here" if recipe.target.device != "cpu" else None)
    if recipe.target.device != "cuda":
        return None
    return gpu.ort_cuda_reason() if artifact.kind == "onnx" else gpu.cuda_reason()
