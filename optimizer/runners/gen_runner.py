"""Generation runners: a greedy loop over PyTorch (stage 0) or the prefill + decode ONNX graphs."""

from __future__ import annotations

from typing import Any

from optimizer.artifact import Artifact
from optimizer.errors import OptimizerError
from optimizer.threads import target_threads


def ort_generator(artifact: Artifact, recipe: Any, device: str | None = None) -> Any:
    import onnxruntime as ort

    from optimizer.generation import OrtGenerator
    from optimizer.runners.ort_runner import providers_for, session_options

    decode = artifact.decode_path()
    if artifact.path is None or decode is None:
        raise OptimizerError(f"{artifact.path}: not a generation artifact (no decode graph)")
    so = session_options(artifact.runtime, target_threads(recipe))
    providers = providers_for({**artifact.runtime, "cuda_graph": False}, device or recipe.target.device)
    try:
        sessions = [ort.InferenceSession(str(p), so, providers=providers) for p in (artifact.path, decode)]
    except Exception as e:
        raise OptimizerError(f"{artifact.path}: onnxruntime cannot load the generation graphs: {e}") from e
    return OrtGenerator(sessions[0], sessions[1], int(artifact.meta["layers"]))


def generator_for(artifact: Artifact, recipe: Any) -> Any:
    if artifact.kind == "torch":
        from optimizer.generation import TorchGenerator
        from optimizer.models import load_module

        return TorchGenerator(load_module(recipe), target_threads(recipe))
    if artifact.kind == "onnx":
        return ort_generator(artifact, recipe)
    raise OptimizerError(f"generation is not supported for {artifact.kind} artifacts yet")
