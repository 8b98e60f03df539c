"""Runners load an artifact with its runtime options and run it. One per runtime; imported lazily."""

from __future__ import annotations

from typing import TYPE_CHECKING

from optimizer.artifact import Artifact

if TYPE_CHECKING:
    from optimizer.recipe import Recipe
    from optimizer.runners.base import Runner


def runner_for(artifact: Artifact, recipe: Recipe) -> Runner:
    if artifact.kind == "torch":
        from optimizer.runners.torch_runner import TorchRunner

        return TorchRunner(artifact, recipe)
    if artifact.kind == "onnx":
        from optimizer.runners.ort_runner import OrtRunner

        return OrtRunner(artifact, recipe)
    raise NotImplementedError(f"no runner for {artifact.kind} artifacts on this machine")
