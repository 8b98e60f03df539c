"""OpenVINO on the CPU: the compile settings an OpenVINO stage runs with, and what its compiled model really ran.

An OpenVINO stage's artifact is an IR (model.xml + model.bin). Its runtime options, like ORT's, are part of the
artifact (set by the `openvino` pass, so their effect is attributed to it):
  ov_precision: default | f32 | bf16 -- OpenVINO's INFERENCE_PRECISION_HINT (default: the device's own choice,
    bf16 on CPUs with bf16 instructions: AVX512_BF16 or AMX)
  ov_hint: latency | throughput -- PERFORMANCE_HINT
  ov_streams: int | None -- NUM_STREAMS (None: as the hint chooses)
  ov_denormals: bool | None -- CPU_DENORMALS_OPTIMIZATION (None: OpenVINO's default)
  ov_static_shapes: bool -- compile the IR reshaped to each input shape it is fed (runners.ov_runner)
Threads come from the recipe's target (INFERENCE_NUM_THREADS). What precision ran is read back from the compiled
model, never assumed: the hint it settled on and the runtime precision of every executed layer (a bf16 request
on a CPU without bf16 runs f32, and INT8 layers run i8 whatever the hint).
"""

from __future__ import annotations

import collections
import functools
import logging
import sys
from pathlib import Path
from typing import Any

from optimizer.core.errors import OptimizerError, install_hint

PRECISIONS = ("default", "f32", "bf16")
HINTS = {"latency": "LATENCY", "throughput": "THROUGHPUT"}


def openvino_reason() -> str | None:
    """Why OpenVINO stages cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("openvino") is None:
        return f"openvino is not installed ({install_hint('openvino')})"
    return None


def openvino_module() -> Any:
    """The openvino package, imported with its telemetry left out: openvino_telemetry (a dependency of NNCF) counts
    every use in ~/intel and sends events; nothing is written outside the folders the user named, so the module is
    marked absent first and OpenVINO's converter and NNCF fall back to their own no-op stubs."""
    sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]
    import openvino

    return openvino


def nncf_module() -> Any:
    """nncf, imported after openvino (telemetry off) and with its INFO log (every step of an accuracy-aware
    search) kept out of the user's terminal: the stage's progress and notes say what it did; warnings still show."""
    openvino_module()
    import nncf

    nncf.set_log_level(logging.WARNING)
    return nncf


def error_line(e: BaseException) -> str:
    """The line of an OpenVINO / NNCF error that says what is wrong: they open with "Check '...' failed at
    <file>:<line>" or "Exception from <file>" and give the reason below."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    noise = ("Check '", "Exception from", "[ GENERAL_ERROR ]", "[ CPU ]", "Traceback")
    useful = [line for line in lines if not line.startswith(noise)]
    return (useful or lines or [type(e).__name__])[0]


def port_name(port: Any, recipe: Any) -> str:
    """The name of a model input the recipe knows: a compiled model may name a port after a node fused into it
    (an FP16 graph's input Cast), while the tensor keeps every name it had (get_names)."""
    wanted = {i.name for i in recipe.inputs}
    return next((n for n in sorted(port.get_names()) if n in wanted), port.get_any_name())


@functools.lru_cache(maxsize=1)
def core() -> Any:
    """One OpenVINO Core per process (it holds the plugins and their caches)."""
    return openvino_module().Core()


def compile_config(runtime: dict[str, Any], threads: int, profile: bool = False) -> dict[str, Any]:
    """The CPU plugin properties of an artifact's runtime options."""
    hint = runtime.get("ov_hint", "latency")
    if hint not in HINTS:
        raise OptimizerError(f"runtime ov_hint: {hint!r} is not one of {', '.join(HINTS)}")
    config: dict[str, Any] = {
        "PERFORMANCE_HINT": HINTS[hint],
        "INFERENCE_NUM_THREADS": int(runtime.get("intra_op_threads") or threads),
    }
    precision = runtime.get("ov_precision", "default")
    if precision != "default":
        config["INFERENCE_PRECISION_HINT"] = precision
    if runtime.get("ov_streams"):
        config["NUM_STREAMS"] = int(runtime["ov_streams"])
    if runtime.get("ov_denormals") is not None:  # OpenVINO's own flush of denormals to zero
        config["CPU_DENORMALS_OPTIMIZATION"] = bool(runtime["ov_denormals"])
    if profile:
        config["PERF_COUNT"] = True
    return config


def compile_model(model: Path | str | Any, runtime: dict[str, Any], threads: int, profile: bool = False) -> Any:
    """The compiled model on the CPU, of an IR file or an openvino.Model (a reshaped one); a load failure is one
    line naming the file or model."""
    source = str(model) if isinstance(model, Path | str) else model
    try:
        return core().compile_model(source, "CPU", compile_config(runtime, threads, profile))
    except Exception as e:  # OpenVINO raises RuntimeError with a multi-line message
        shapes = None if isinstance(model, Path | str) else [str(p.get_partial_shape()) for p in model.inputs]
        name = model if shapes is None else f"the IR reshaped to {shapes}"
        raise OptimizerError(f"{name}: OpenVINO cannot compile it: {error_line(e)}") from e


def _any(value: Any) -> str:
    return str(value.astype(str)) if hasattr(value, "astype") else str(value)


def runtime_precisions(compiled: Any) -> dict[str, int]:
    """Executed layers per runtime precision (the compiled model's execution graph), e.g. {"bf16": 84, "i8": 36}.
    Inputs, outputs and constants are left out: they say nothing about the arithmetic."""
    counts: collections.Counter[str] = collections.Counter()
    for op in compiled.get_runtime_model().get_ops():
        info = op.get_rt_info()
        if _any(info["layerType"]) in ("Input", "Output", "Const", "Parameter", "Result"):
            continue
        counts[_any(info["runtimePrecision"])] += 1
    return dict(counts.most_common())


def precision_ran(compiled: Any, asked: str, capabilities: list[str]) -> dict[str, Any]:
    """What a stage asked for and what ran: the hint the compiled model settled on, the layers per precision, and
    a note when a bf16 request ran without bf16 (a CPU without it: OpenVINO falls back to f32)."""
    value = compiled.get_property("INFERENCE_PRECISION_HINT")  # an openvino Type: "bf16", "f32", "f16"
    hint = value.get_type_name() if hasattr(value, "get_type_name") else str(value)
    layers = runtime_precisions(compiled)
    out: dict[str, Any] = {"asked": asked, "hint": hint, "layers": layers}
    if asked == "bf16" and "bf16" not in layers:
        out["note"] = (f"bf16 asked, but this CPU has no bf16 (OpenVINO's capabilities: {', '.join(capabilities)}): "
                       f"ran {hint}")
    return out


def capabilities() -> list[str]:
    return [str(c) for c in core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")]


def op_times(request: Any) -> tuple[dict[str, float], int]:
    """Milliseconds per layer type of the last inference (OpenVINO's performance counters: PERF_COUNT), and the
    number of layers that executed."""
    ov = openvino_module()

    times: collections.Counter[str] = collections.Counter()
    executed = 0
    for info in request.profiling_info:
        if info.status != ov.ProfilingInfo.Status.EXECUTED:
            continue
        executed += 1
        times[info.node_type] += info.real_time.total_seconds() * 1000
    return dict(times), executed


def ir_op_types(xml: Path | str) -> dict[str, int]:
    """Op types of an IR as saved (before the CPU plugin's own fusions), parameters and constants left out."""
    model = core().read_model(str(xml))
    counts = collections.Counter(op.get_type_name() for op in model.get_ops())
    for skip in ("Parameter", "Result", "Constant"):
        counts.pop(skip, None)
    return dict(counts.most_common())
