"""Generation runners: a greedy loop over PyTorch (stage 0, static-cache and CUDA-graph stages) or over the
prefill + decode ONNX graphs (ONNX Runtime; IO binding on the CUDA EP so the KV cache stays on the device); for
encoder-decoders (model.task text2text-generation / automatic-speech-recognition) the loop of runtime.seq2seq."""

from __future__ import annotations

from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError
from optimizer.recipe.schema import SEQ2SEQ_TASKS
from optimizer.runtime.threads import target_threads

SEQ2SEQ_CPU_ONLY = "target.device: cuda, but encoder-decoder (seq2seq) generation is built for the CPU only so far"


def ort_loop(prefill: Any, decode: Any, layers: int, device: str) -> Any:
    """The greedy loop over a prefill and a decode session: an encoder-decoder's (its decode graph takes
    cross-attention K/V) or a decoder's, with IO binding on CUDA. Raises OptimizerError for an encoder-decoder on
    CUDA (its loop is built for the CPU only)."""
    from optimizer.runtime.generation import OrtBoundGenerator, OrtGenerator
    from optimizer.runtime.seq2seq import OrtSeq2SeqGenerator, is_seq2seq_session

    if is_seq2seq_session(decode):
        if device == "cuda":
            raise OptimizerError(SEQ2SEQ_CPU_ONLY)
        return OrtSeq2SeqGenerator(prefill, decode, layers)
    if device == "cuda":
        return OrtBoundGenerator(prefill, decode, layers, "cuda")
    return OrtGenerator(prefill, decode, layers)


def ort_generator(artifact: Artifact, recipe: Any, device: str | None = None) -> Any:
    from optimizer.runtime.sessions import ort_session

    device = device or recipe.target.device
    decode = artifact.decode_path()
    if artifact.path is None or decode is None:
        raise OptimizerError(f"{artifact.path}: not a generation artifact (no decode graph)")
    runtime = {**artifact.runtime, "cuda_graph": False}
    sessions = [ort_session(p, runtime, target_threads(recipe), device) for p in (artifact.path, decode)]
    return ort_loop(sessions[0], sessions[1], artifact.decoder_layers(), device)


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
    if getattr(recipe.model, "task", None) in SEQ2SEQ_TASKS:
        if device == "cuda":
            raise OptimizerError(SEQ2SEQ_CPU_ONLY)
        if artifact.runtime.get("kv_cache") == "static" or artifact.runtime.get("cuda_graph"):
            raise OptimizerError("a static KV cache and CUDA graphs are built for decoders (causal-lm), not yet "
                                 f"for encoder-decoders (model.task {recipe.model.task})")
        from optimizer.runtime.seq2seq import TorchSeq2SeqGenerator

        return TorchSeq2SeqGenerator(model, threads, device)
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
