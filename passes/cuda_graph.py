"""CUDA Graph capture as a stage of its own: same model, launched as one captured graph per input shape.

The artifact is the parent's, with the runtime option cuda_graph switched on; its runner (PyTorch, ONNX Runtime
CUDA EP, TensorRT) warms up, captures and replays with static input and output buffers. Keeping this a stage
means its gain (fewer kernel launches, no per-launch CPU work) is attributed here, never folded silently into
the TensorRT or ONNX Runtime stage before it.

Eligibility, checked before anything runs: a CUDA device and target.device cuda; for ONNX, onnxruntime-gpu,
no data-dependent control flow (If/Loop/Scan), and every node placed on the CUDA EP (a CPU-fallback node
breaks capture); for a PyTorch forward, no op that reads a tensor back to the host on any scenario's input
(transformers' mask builders check a 2-D attention mask with one: illegal while capturing). Shapes are static
per scenario, which is what capture needs; one graph per scenario, each captured once during the pass.
"""

from __future__ import annotations

from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassResult


class CudaGraphConfig(PassConfig):
    pass


class CudaGraphPass(Pass):
    name = "cuda_graph"
    summary = "CUDA Graph capture/replay (PyTorch, ORT CUDA EP, TensorRT), as its own stage"
    Config = CudaGraphConfig
    consumes = frozenset({"torch", "onnx", "trt_engine"})
    handles_generation = True  # the PyTorch decode step over a static KV cache; the ONNX decode graph declines

    @classmethod
    def environment_reason(cls) -> str | None:
        from optimizer.runtime.gpu import cuda_reason

        return cuda_reason()

    def skip_reason(self, artifact: Artifact, ctx: PassContext) -> str | None:
        reason = super().skip_reason(artifact, ctx)
        if reason:
            return reason
        if ctx.recipe.target.device != "cuda":
            return "target.device is cpu: CUDA graphs need target.device: cuda"
        if artifact.decode:
            return (
                "the ONNX decode graph grows its KV cache by one position per token (new shapes every step), so "
                "ONNX Runtime cannot capture it; a static-cache decode graph is not exported yet"
            )
        growing = artifact.runtime.get("kv_cache") != "static"
        if ctx.recipe.workload == "generation" and artifact.kind == "torch" and growing:
            return "a decoder with a growing KV cache cannot be captured: put a static_kv_cache stage before it"
        if artifact.kind == "torch" and ctx.recipe.workload == "forward":
            with ctx.session(artifact, "cpu") as session:
                reads = forward_host_reads(session, ctx.feeds)
            if reads:
                return (f"the forward reads tensors back to the host ({', '.join(reads)}; transformers' attention-mask "
                        "builder does so with a 2-D mask), which CUDA graph capture cannot do: capture an ONNX stage "
                        "(ONNX Runtime or TensorRT) instead")
        if artifact.kind == "onnx":
            return onnx_blockers(artifact)
        if artifact.kind == "trt_engine":
            from optimizer.runtime.gpu import tensorrt_reason

            return tensorrt_reason()
        return None

    def run(self, artifact: Artifact, ctx: PassContext) -> PassResult:
        if artifact.path is None and ctx.recipe.workload == "generation":
            out = artifact.with_runtime(cuda_graph=True)
            return PassResult(out, modified=True, notes={"captured": "torch decode step", **_check_decode(ctx)})
        if artifact.path is None:  # a PyTorch source: nothing to copy, the runner captures the module
            out = artifact.with_runtime(cuda_graph=True)
        else:
            out = artifact.copy_to(ctx.stage_dir).with_runtime(cuda_graph=True)  # with its external data
        try:  # capture once now, on the target, every scenario's graph: fail here, not in the benchmark
            with ctx.session(out, ctx.recipe.target.device) as session:
                for sf in ctx.feeds:
                    session.run(session.prepare(sf.timing))
        except Exception as e:
            raise PassError(f"CUDA graph capture failed: {e}") from e
        return PassResult(out, modified=True, notes={"captured": artifact.kind, "graphs": len(ctx.recipe.scenarios)})


def forward_host_reads(session: Any, feeds: Any) -> list[str]:
    """The ops of a PyTorch forward (a CPU TorchSession) that read a tensor back to the host, on each scenario's
    timing input: what makes its capture fail on the device (generation_static.host_reads)."""
    import torch

    from optimizer.runtime.generation_static import host_reads

    found: set[str] = set()
    for sf in feeds:
        tensors = session.prepare(sf.timing)
        with torch.inference_mode():
            found.update(host_reads(session.module, *tensors)[1])
    return sorted(found)


def _check_decode(ctx: PassContext) -> dict[str, object]:
    """Capture once now and compare the replayed loop with the same loop run eagerly, on the device."""
    from optimizer.runtime.generation_static import StaticCacheGenerator
    from optimizer.runtime.models import load_module

    prompt = next(iter(ctx.feeds)).timing["input_ids"]
    try:
        model = load_module(ctx.recipe)  # one copy on the device; each generator has its own cache buffers
        eager = StaticCacheGenerator(model, 1, "cuda").generate(prompt, 8)
        graphed = StaticCacheGenerator(model, 1, "cuda", cuda_graph=True)
        got = graphed.generate(prompt, 8)
    except Exception as e:
        raise PassError(f"CUDA graph capture of the decode step failed: {e}") from e
    check = ctx.check(eager, got)
    if check["token_agreement"] < 1.0:
        raise PassError(f"the replayed decode step disagrees with eager: {check}")
    return {"check": check, "graphs": graphed.captures}


def onnx_blockers(artifact: Artifact) -> str | None:
    """Why ORT's CUDA EP cannot capture this graph, or None."""
    from optimizer.runtime.gpu import ort_cuda_reason
    from optimizer.runtime.gpu.profiles import cuda_graph_blockers
    from optimizer.runtime.onnx_io import op_histogram

    reason = ort_cuda_reason()
    if reason:
        return reason
    assert artifact.path is not None
    blockers = cuda_graph_blockers(op_histogram(artifact.path))
    if blockers:
        return f"control-flow ops {', '.join(blockers)} cannot be captured"
    from optimizer.core.errors import OptimizerError
    from optimizer.runtime.sessions import ort_session

    try:  # ORT's default session options (all optimizations, its thread count): where nodes land as a user's would
        ort_session(
            artifact.path,
            {"graph_optimization_level": "all"},
            0,
            "cuda",
            config={"session.disable_cpu_ep_fallback": "1"},
            providers=["CUDAExecutionProvider"],
        )
    except OptimizerError as e:
        return f"some nodes cannot run on the CUDA EP, so the graph cannot be captured ({str(e).splitlines()[0]})"
    return None
