"""CUDA Graph capture as a stage of its own: same model, launched as one captured graph per input shape.

The artifact is the parent's, with the runtime option cuda_graph switched on; its runner (PyTorch, ONNX Runtime
CUDA EP, TensorRT) warms up, captures and replays with static input and output buffers. Keeping this a stage
means its gain (fewer kernel launches, no per-launch CPU work) is attributed here, never folded silently into
the TensorRT or ONNX Runtime stage before it.

Eligibility, checked before anything runs: a CUDA device and target.device cuda; for ONNX, onnxruntime-gpu,
no data-dependent control flow (If/Loop/Scan), and no host-device copy in the graph ORT places (its own rule:
shape nodes it keeps on the CPU are fine); for a PyTorch forward, no op that reads a tensor back to the host on
any scenario's input (transformers' mask builders check a 2-D attention mask with one: illegal while
capturing). Shapes are static per scenario, which is what capture needs; one graph per scenario, each captured
once during the pass and verified to replay as a graph launch (CUPTI): a runtime may decline a capture with a
warning only.
"""

from __future__ import annotations

from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.pass_base import Pass, PassConfig, PassContext, PassResult


class CudaGraphConfig(PassConfig):
    pass


class CudaGraphPass(Pass[CudaGraphConfig]):
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
                launches = verify_captured(session, ctx.feeds)
        except PassError:
            raise
        except Exception as e:
            raise PassError(f"CUDA graph capture failed: {e}") from e
        notes = {"captured": artifact.kind, "graphs": len(ctx.recipe.scenarios), "verified": launches}
        return PassResult(out, modified=True, notes=notes)


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
    return memcpy_reason(artifact.path)


MEMCPY_OPS = ("MemcpyToHost", "MemcpyFromHost")


def memcpy_reason(path: Any) -> str | None:
    """ORT's own rule for capture: no copy between host and device inside the graph. Nodes it deliberately keeps
    on the CPU (shape arithmetic on CPU tensors) are capturable; a node whose device tensor must cross to the
    host is not. The session ORT builds (CUDA EP, CPU fallback allowed, its default optimizations) is saved
    after placement, where its Memcpy nodes show; None when there are none."""
    import tempfile
    from pathlib import Path

    from optimizer.core.errors import OptimizerError
    from optimizer.runtime import onnx_io
    from optimizer.runtime.sessions import ort_session

    with tempfile.TemporaryDirectory(prefix="cuda-graph-placement-") as tmp:
        placed = Path(tmp) / "placed.onnx"
        try:
            ort_session(path, {"graph_optimization_level": "all"}, 0, "cuda", optimized_path=str(placed))
        except OptimizerError as e:
            return f"onnxruntime cannot open it on the CUDA EP ({str(e).splitlines()[0]})"
        copies = [n for n in onnx_io.load(placed, with_weights=False).graph.node if n.op_type in MEMCPY_OPS]
    if copies:
        names = ", ".join(n.name or n.output[0] for n in copies[:3])
        return (f"onnxruntime places part of the graph on the CPU with {len(copies)} host-device copies inside it "
                f"({names}{', ...' if len(copies) > 3 else ''}), which a CUDA graph cannot capture")
    return None


def verify_captured(session: Any, feeds: Any) -> dict[str, Any]:
    """That a replay is one graph launch (CUPTI, through the PyTorch profiler) on every scenario's input: ORT
    declines a capture with a warning only, and the stage would say "captured" while running eagerly. The
    counts per scenario; PassError when a replay launched no graph; {"reason"} when the profiler cannot tell."""
    from optimizer.runtime.gpu.kernels import profile_kernels

    found: dict[str, Any] = {}
    for sf in feeds:
        prepared = session.prepare(sf.timing)
        counts = profile_kernels(lambda p=prepared: session.run(p))
        if "reason" in counts:
            return {"reason": f"capture not verified: {counts['reason']}"}
        if not counts.get("graph_launches"):
            raise PassError(f"no CUDA graph was launched on {sf.scenario.name}: the runtime ran the stage eagerly "
                            f"({counts['launches']:.0f} kernel launches per call), so it is not captured")
        found[sf.scenario.name] = counts
    return found
