"""Generation runners: a greedy loop over PyTorch (stage 0, static-cache and CUDA-graph stages) or over the
prefill + decode ONNX graphs (ONNX Runtime; IO binding on the CUDA EP so the KV cache stays on the device)."""

from __future__ import annotations

from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError
from optimizer.runtime.threads import target_threads


def ort_generator(artifact: Artifact, recipe: Any, device: str | None = None) -> Any:
    from optimizer.runtime.generation import OrtBoundGenerator, OrtGenerator
    from optimizer.runtime.sessions import ort_session

    device = device or recipe.target.device
    decode = artifact.decode_path()
    if artifact.path is None or decode is None:
        raise OptimizerError(f"{artifact.path}: not a generation artifact (no decode graph)")
    runtime = {**artifact.runtime, "cuda_graph": False}
    sessions = [ort_session(p, runtime, target_threads(recipe), device) for p in (artifact.path, decode)]
    layers = artifact.decoder_layers()
    if device == "cuda":
        return OrtBoundGenerator(sessions[0], sessions[1], layers, "cuda")
    return OrtGenerator(sessions[0], sessions[1], layers)


def genai_generator(artifact: Artifact, recipe: Any, profile_prefix: str | None = None) -> Any:
    """A decoder in GenAI's layout: one session, the KV cache bound in place (runtime.generation_shared)."""
    from optimizer.runtime.generation_shared import GenaiLayout, SharedBufferGenerator
    from optimizer.runtime.sessions import ort_session

    config = artifact.genai_config_path()
    if artifact.path is None or config is None:
        raise OptimizerError(f"{artifact.path}: not a decoder in GenAI's layout (no genai_config.json)")
    if recipe.target.device != "cpu":
        raise OptimizerError("target.device: cuda, but GenAI-layout stages run on the CPU here")
    session = ort_session(artifact.path, artifact.runtime, target_threads(recipe), "cpu", profile_prefix=profile_prefix)
    return SharedBufferGenerator(session, GenaiLayout.read(config))


def torch_generator(artifact: Artifact, recipe: Any) -> Any:
    """Stage 0 (dynamic cache), or the static_kv_cache / cuda_graph stages built on it (runtime options)."""
    from optimizer.runtime.gpu import cuda_reason
    from optimizer.runtime.models import load_module

    device = recipe.target.device
    if device == "cuda" and cuda_reason() is not None:
        raise OptimizerError(f"target.device: cuda, but {cuda_reason()}")
    model, threads = load_module(recipe), target_threads(recipe)
    if artifact.runtime.get("kv_cache") == "static":
        from optimizer.runtime.generation_static import StaticCacheGenerator

        return StaticCacheGenerator(model, threads, device, bool(artifact.runtime.get("cuda_graph")))
    if artifact.runtime.get("cuda_graph"):
        raise OptimizerError("cuda_graph on a generation stage needs a static KV cache (a static_kv_cache stage)")
    from optimizer.runtime.generation import TorchGenerator

    return TorchGenerator(model, threads, device)


def generator_for(artifact: Artifact, recipe: Any) -> Any:
    if artifact.kind == "torch":
        return torch_generator(artifact, recipe)
    if artifact.kind == "onnx" and artifact.genai_files:
        return genai_generator(artifact, recipe)
    if artifact.kind == "onnx":
        return ort_generator(artifact, recipe)
    raise OptimizerError(f"generation is not supported for {artifact.kind} artifacts yet")
