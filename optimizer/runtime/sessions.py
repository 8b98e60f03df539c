"""The one ONNX Runtime session factory: every session the tool opens (runners, generation loops, passes'
probes, bundles) is created here, with the artifact's runtime options as session options, the providers of the
device, a CUDA session that silently fell back to the CPU refused, and a load failure as one line naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optimizer.core.errors import OptimizerError
from optimizer.runtime.denormals import ORT_CONFIG_KEY, FlushingSession, settle_after_create


def ort_session(
    path: Path | str | bytes | None,
    runtime: dict[str, Any],
    threads: int,
    device: str = "cpu",
    *,
    optimized_path: str | None = None,
    profile_prefix: str | None = None,
    config: dict[str, str] | None = None,
    providers: list[Any] | None = None,
    compute_stream: int | None = None,
) -> Any:
    """An onnxruntime.InferenceSession. path: a file, or a serialized model (bytes). config: session config
    entries (e.g. session.disable_cpu_ep_fallback). providers: only to override those of the device.
    compute_stream: on CUDA, the handle of the stream ORT computes on (providers_for)."""
    import onnxruntime as ort

    from optimizer.runtime.gpu import ort_cuda_reason

    if device == "cuda" and providers is None and ort_cuda_reason() is not None:
        raise OptimizerError(f"target.device: cuda, but {ort_cuda_reason()}")
    so = session_options(runtime, threads, optimized_path)
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    for key, value in (config or {}).items():
        so.add_session_config_entry(key, value)
    source = path if isinstance(path, bytes) else str(path)
    where = "<in-memory model>" if isinstance(path, bytes) else str(path)
    try:
        # ORT's own load-time fusions a stage measured as slower on its target (the fuse pass's kernel choice):
        # a session that made them again would not run the graph that was measured.
        disabled = list(runtime.get("disabled_optimizers") or [])
        extra = {"disabled_optimizers": disabled} if disabled else {}
        chosen = providers or providers_for(runtime, device, compute_stream)
        session = ort.InferenceSession(source, so, providers=chosen, **extra)
    except Exception as e:  # ORT raises its own exception types (Fail, InvalidGraph, NotImplemented)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise OptimizerError(f"{where}: onnxruntime cannot load it: {first}") from e
    if providers is None:
        check_providers(session, device, where)
    if runtime.get("denormal_as_zero"):  # the calling thread flushes during this session's calls only
        settle_after_create()
        return FlushingSession(session)
    return session


# ORT's session config keys for whether idle pool threads spin (busy-wait) for work before sleeping.
SPIN_KEYS = ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning")


def session_options(runtime: dict[str, Any], threads: int, optimized_path: str | None = None) -> Any:
    """SessionOptions from an artifact's runtime settings (set by the `ort_session` pass, so their effect is
    measured as a stage): graph_optimization_level, execution_mode, inter_op_threads; intra_op_threads (default:
    `threads`, the target's); allow_spinning (absent or None: ORT's default, spinning on). The generation loop's
    prefill and decode sessions each get their own pools, and spinning threads of one compete with the other's
    for the cores; allow_spinning false makes idle threads sleep instead. shared_thread_pool: every session runs
    on ONNX Runtime's one process-wide pool (see shared_pool) instead of a pool of its own. denormal_as_zero:
    denormal floats flushed to zero (runtime.denormals). dynamic_block_base: ORT's session.dynamic_block_base."""
    import onnxruntime as ort

    level = runtime.get("graph_optimization_level", "disable_all")
    so = ort.SessionOptions()
    so.graph_optimization_level = {
        "disable_all": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    intra, inter = int(runtime.get("intra_op_threads") or threads), int(runtime.get("inter_op_threads", 1))
    if runtime.get("shared_thread_pool"):
        shared_pool(intra, inter)
        so.use_per_session_threads = False  # sizes stay 0: ORT warns that a session's sizes are ignored here
    elif _SHARED_POOL:  # ORT's own refusal is a multi-line EP error followed by a retry that fails alike
        raise OptimizerError(
            "runtime.shared_thread_pool: this process runs onnxruntime's shared pool, and onnxruntime then refuses "
            "a session with a pool of its own (use_per_session_threads must be false)"
        )
    else:
        so.intra_op_num_threads, so.inter_op_num_threads = intra, inter
    so.execution_mode = (
        ort.ExecutionMode.ORT_PARALLEL
        if runtime.get("execution_mode") == "parallel"
        else ort.ExecutionMode.ORT_SEQUENTIAL
    )
    so.log_severity_level = 3
    spinning = runtime.get("allow_spinning")
    if spinning is not None and not runtime.get("shared_thread_pool"):  # both pools; the shared one ignores it
        for key in SPIN_KEYS:
            so.add_session_config_entry(key, "1" if spinning else "0")
    if runtime.get("denormal_as_zero"):  # the pool threads; the calling thread: denormals.FlushingSession
        so.add_session_config_entry(ORT_CONFIG_KEY, "1")
    if runtime.get("dynamic_block_base"):  # work handed out in shrinking blocks: evens out a decode step's small ops
        so.add_session_config_entry("session.dynamic_block_base", str(int(runtime["dynamic_block_base"])))
    if optimized_path:
        so.optimized_model_filepath = optimized_path
    return so


# ONNX Runtime creates its global (process-wide) pools once; Python can size them but never resize them.
_SHARED_POOL: dict[str, int] = {}


def shared_pool(intra: int, inter: int = 1) -> dict[str, Any]:
    """ONNX Runtime's process-wide intra/inter-op pools, created on first use; sessions opened with
    use_per_session_threads = False run on them (the prefill and decode sessions then share one pool instead of
    keeping two). From Python only their sizes can be set (onnxruntime.set_global_thread_pool_sizes): the C API's
    SetGlobalSpinControl is not exposed, so the shared pool spins (ORT's default) and a session's allow_spinning
    does not reach it. A second size in one process cannot be had, nor, once it exists, a session with a pool of
    its own (ORT refuses it): one-line errors. So it is all or nothing for a process (a deployment's choice)."""
    import onnxruntime as ort

    if not _SHARED_POOL:
        try:
            ort.set_global_thread_pool_sizes(intra, inter)
        except Exception as e:  # ORT's Fail: the global pools exist already (created outside this module)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise OptimizerError(f"runtime.shared_thread_pool: onnxruntime cannot create its pools: {first}") from e
        _SHARED_POOL.update(intra_op_threads=intra, inter_op_threads=inter)
    elif (_SHARED_POOL["intra_op_threads"], _SHARED_POOL["inter_op_threads"]) != (intra, inter):
        raise OptimizerError(
            f"runtime.shared_thread_pool: this process's shared pool has {_SHARED_POOL['intra_op_threads']} intra-op"
            f" threads; {intra} asked (ONNX Runtime creates its global pools once per process)"
        )
    return {**_SHARED_POOL, "allow_spinning": True}


def thread_settings(runtime: dict[str, Any], threads: int) -> dict[str, Any]:
    """What the sessions of an artifact will run with, as a stage records it: the pool (per session or shared),
    its intra-op threads and whether idle threads spin (None: ORT's default, on)."""
    intra = int(runtime.get("intra_op_threads") or threads)
    if runtime.get("shared_thread_pool"):
        return {"pool": "shared", "intra_op_threads": intra, "allow_spinning": True}
    return {"pool": "per_session", "intra_op_threads": intra, "allow_spinning": runtime.get("allow_spinning")}


CUDA_PROVIDER_KEYS = ("enable_cuda_graph", "has_user_compute_stream", "user_compute_stream")
CUDA_RUN_KEYS = ("gpu_graph_id", "disable_synchronize_execution_providers")


def providers_for(runtime: dict[str, Any], device: str, compute_stream: int | None = None) -> list[Any]:
    """ORT providers for a device. On CUDA, ORT computes on a stream of its session's own (`user_compute_stream`):
    the caller's (whose CUDA events then time ORT's kernels: OrtCudaSession), or a new one. Never torch's
    current stream by default: outside a `torch.cuda.stream` block that is the legacy default stream (handle 0),
    on which CUDA refuses to begin a graph capture."""
    if device != "cuda":
        return ["CPUExecutionProvider"]
    if compute_stream is None:
        import torch

        compute_stream = torch.cuda.Stream().cuda_stream  # torch keeps its streams for the process's life
    if not compute_stream:
        raise OptimizerError("onnxruntime on CUDA: the compute stream is the legacy default stream (handle 0), on "
                             "which CUDA graphs cannot be captured; give the session a stream of its own")
    options = {
        "enable_cuda_graph": "1" if runtime.get("cuda_graph") else "0",
        "has_user_compute_stream": "1",
        "user_compute_stream": str(compute_stream),
    }
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


def check_providers(session: Any, device: str, path: Any) -> None:
    """ORT opens a session with the CPU provider alone when the CUDA provider cannot load (a CUDA runtime or
    cuDNN of another major, say) and says so only in a log line: everything "on CUDA" would then run on the
    CPU. Refuse that, with the reason."""
    if device == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        raise OptimizerError(
            f"{path}: onnxruntime opened the session without its CUDA execution provider (providers in use: "
            f"{', '.join(session.get_providers())}); the CUDA provider could not load here, often a CUDA or cuDNN "
            "of another major than this onnxruntime-gpu build links"
        )
