"""Kernels per call on CUDA: how many ran on the device and how many launches the host issued for them.

The seeds' slow "Flash" model made 37% more kernel launches than its base; that count is what this measures,
for any runtime in the process (PyTorch, ONNX Runtime's CUDA EP, TensorRT), because CUPTI (through the PyTorch
profiler, Kineto) records every kernel and every launch API call of the process, whoever made it.

Two numbers, because CUDA graphs separate them: a replayed graph still runs every kernel (`kernels` stays) but
the host launches it with one call (`launches` drops to `graph_launches`). Launch-bound models gain from the
second number falling, which is why both are in the report.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

# Host API calls that put kernels on a stream (runtime and driver API spellings; cuBLAS and TensorRT use both).
KERNEL_LAUNCH_APIS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cudaLaunchCooperativeKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuLaunchCooperativeKernel",
)
GRAPH_LAUNCH_APIS = ("cudaGraphLaunch", "cuGraphLaunch")
# Entry points may carry a version or per-thread-stream suffix: cudaLaunchKernel_ptsz, cuLaunchKernelEx_v12000.
_API_SUFFIX = re.compile(r"(_v\d+|_ptsz|_ptds)+$")


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Milliseconds during which at least one of the (start µs, duration µs) intervals ran: kernels overlapping on
    two streams count once."""
    total, end = 0.0, float("-inf")
    for start, dur in sorted(intervals):
        stop = start + dur
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1000.0


def count_trace_events(events: Iterable[Mapping[str, Any]], calls: int) -> dict[str, float]:
    """Per-call counts from Chrome-trace events (Kineto's categories: kernel, gpu_memcpy, cuda_runtime...), and
    `busy_ms`: the time per call at least one kernel ran on the device (the GPU's busy time, no launch gaps)."""
    kernels = memcpy = launches = graph_launches = 0
    spans: list[tuple[float, float]] = []
    for ev in events:
        cat, name = ev.get("cat", ""), ev.get("name", "")
        if cat == "kernel":
            kernels += 1
            spans.append((float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))))
        elif cat in ("gpu_memcpy", "gpu_memset"):
            memcpy += 1
        elif cat in ("cuda_runtime", "cuda_driver"):
            api = _API_SUFFIX.sub("", name)
            if api in KERNEL_LAUNCH_APIS:
                launches += 1
            elif api in GRAPH_LAUNCH_APIS:
                graph_launches += 1
    n = max(calls, 1)
    return {
        "kernels": kernels / n,
        "launches": (launches + graph_launches) / n,
        "graph_launches": graph_launches / n,
        "memcpy": memcpy / n,
        "busy_ms": busy_ms(spans) / n,
        "calls": calls,
    }


def trace_events(fn: Callable[[], Any], calls: int, cuda: bool) -> list[dict[str, Any]]:
    """Chrome-trace events of fn run `calls` times under the PyTorch profiler (CPU activity always: it is what
    records the host's CUDA runtime calls, the launches; CUDA activity for the kernels themselves)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        return list(json.loads(trace.read_text()).get("traceEvents", []))


def profile_kernels(fn: Callable[[], Any], calls: int = 3) -> dict[str, Any]:
    """Kernels and launches per call of fn on CUDA.

    Returns {"reason": ...} instead when the profiler cannot trace CUDA here, so a report says why the column is
    empty rather than showing a zero."""
    from optimizer.runtime.gpu import cuda_reason

    if cuda_reason() is not None:
        return {"reason": cuda_reason()}
    import torch

    torch.cuda.synchronize()
    try:
        events = trace_events(fn, calls, cuda=True)
    except Exception as e:  # CUPTI missing or busy (another profiler attached): say so, do not fail the stage
        return {"reason": f"CUDA profiler unavailable: {str(e).splitlines()[0] if str(e) else type(e).__name__}"}
    counts = count_trace_events(events, calls)
    if counts["kernels"] == 0 and counts["launches"] == 0:
        return {"reason": "the CUDA profiler recorded no kernels and no launches (CUPTI tracing unavailable?)"}
    return counts
