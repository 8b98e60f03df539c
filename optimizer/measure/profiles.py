"""Op-type time from the PyTorch profiler (PyTorch stages) and per-kernel time from CUPTI (any CUDA stage).

PyTorch stages: the time of each outermost aten op (aten::linear with the aten::addmm it calls inside, not both),
so the ops partition the profiled time the way ONNX Runtime's node times do; on CUDA, the device time of the
kernels each op launched. The names stay PyTorch's: aten::linear is not a MatMul, and the report compares the
two runtimes' profiles by their totals and top ops only (report.explain).

CUDA stages, whichever runtime launched the kernels (PyTorch, ONNX Runtime's CUDA EP, TensorRT): the device time
per kernel name, from the Chrome trace of the PyTorch profiler's CUDA activity (Kineto over CUPTI), the trace
runtime.gpu.kernels counts launches from. Kernel names are the one vocabulary two runtimes share on a GPU.

Generation: ONNX Runtime profiles its prefill and decode sessions apart (one profile file each); a PyTorch loop
has no such seam, so its decode step is (a whole generation - a prefill-only generation) / decode steps.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.core.metrics import NodeTimes, ScenarioProfile
from optimizer.core.quiet import drop_native_lines
from optimizer.recipe.schema import Recipe
from optimizer.runtime.runners.ort_runner import RunProfile

MIN_MS = 1e-4  # op types below this per call are dropped (a decode step's difference of two profiles is noisy)


@dataclass
class OpProfile:
    """Per call: ms per op type (ops) and ms per CUDA kernel name (kernels); nodes: kernels ORT ran per call;
    node_time: ORT's slowest nodes by name with totals (core.metrics.NodeTimes)."""

    ops: dict[str, float] = field(default_factory=dict)
    kernels: dict[str, float] = field(default_factory=dict)
    nodes: int | None = None
    node_time: NodeTimes | None = None


def digest(name: str) -> str:
    """8 hex digits naming a node: membership without storing every name (a collision in ~1e5 pairs of names)."""
    return hashlib.blake2b(name.encode(), digest_size=4).hexdigest()


def node_times(prof: RunProfile) -> NodeTimes | None:
    """ORT's per-node profile as the metrics keep it: the slowest nodes, totals, and every node's digest."""
    if not prof.node_count:
        return None
    return NodeTimes(
        top=[(k, prof.node_ops.get(k, "?"), round(v, 5)) for k, v in prof.nodes.items()],
        nodes=prof.node_count,
        total_ms=round(prof.node_total_ms, 5),
        digests=sorted({digest(n) for n in prof.names}),
    )


def ort_op_profile(prof: RunProfile) -> OpProfile:
    return OpProfile(_sorted(prof.ops, 1), nodes=prof.kernels, node_time=node_times(prof))


def scenario_profile(call: OpProfile, source: str | None, prefill: OpProfile | None = None) -> ScenarioProfile:
    """One scenario's profile as ScenarioMetrics.profile holds it: per call (generation: decode step) and prefill."""
    pre = prefill or OpProfile()
    return ScenarioProfile(
        source=source,
        op_time_ms=call.ops,
        prefill_op_time_ms=pre.ops,
        kernel_time_ms=call.kernels,
        prefill_kernel_time_ms=pre.kernels,
        node_time=call.node_time,
        prefill_node_time=pre.node_time,
        nodes_executed=call.nodes,
    )


def _sorted(times: Mapping[str, float], calls: float) -> dict[str, float]:
    n = max(calls, 1)
    return {k: v / n for k, v in sorted(times.items(), key=lambda kv: -kv[1]) if v / n >= MIN_MS}


# ------------------------------------------------------------------ PyTorch ops
MARK = "optimizer::call#"  # a record_function range around each profiled call


def ops_per_call(events: Iterable[Any], cuda: bool) -> list[dict[str, float]]:
    """Ms per name of the outermost aten ops (no aten op above them) in each marked call: host time on the CPU,
    the device time of their kernels on CUDA. `events`: the profiler's FunctionEvents (name, cpu_parent,
    cpu_time_total, device_time_total in microseconds); ops outside every mark are left out."""
    calls: dict[int, dict[str, float]] = {}
    for ev in events:
        if not ev.name.startswith("aten::"):
            continue
        parent = ev.cpu_parent
        while parent is not None and not parent.name.startswith(("aten::", MARK)):
            parent = parent.cpu_parent
        if parent is None or not parent.name.startswith(MARK):
            continue  # inside another aten op, or outside the calls
        times = calls.setdefault(int(parent.name[len(MARK) :]), {})
        us = ev.device_time_total if cuda else ev.cpu_time_total
        times[ev.name] = times.get(ev.name, 0.0) + float(us) / 1000.0
    return [calls[i] for i in sorted(calls)]


def median_per_name(calls: list[dict[str, float]]) -> dict[str, float]:
    """Per name, the median over calls (a call without it counts 0): one call the scheduler preempted does not
    move it, which a sum over a few generations on a busy machine did (an aten::layer_norm read 2 ms in a tiny
    model's prefill)."""
    names = {k for c in calls for k in c}
    return {k: float(np.median([c.get(k, 0.0) for c in calls])) for k in names}


def profile_torch(fn: Callable[[], Any], calls: int, cuda: bool) -> tuple[dict[str, float], dict[str, float]]:
    """(ms per outermost aten op, median per call; ms per CUDA kernel name, mean per call) over `calls` calls of
    fn, after one unprofiled warm-up call (the profiler's first events carry its own start-up)."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    # Kineto prints "USDT: ... SyncActivityProfilerHandler.cpp ... profiler_start/stop" from C++ on every session
    with drop_native_lines(r"^USDT:.*ActivityProfiler"), profile(activities=activities) as prof:
        for i in range(calls):
            with record_function(f"{MARK}{i}"):
                fn()
        if cuda:
            torch.cuda.synchronize()
    ops = median_per_name(ops_per_call(prof.events(), cuda))
    kernels: dict[str, float] = {}
    if cuda:
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            totals = kernel_totals(json.loads(trace.read_text()).get("traceEvents", []))
            kernels = {k: v / max(calls, 1) for k, v in totals.items()}
    return ops, kernels


def torch_profile(fn: Callable[[], Any], calls: int, cuda: bool) -> OpProfile:
    ops, kernels = profile_torch(fn, calls, cuda)
    return OpProfile(_sorted(ops, 1), _sorted(kernels, 1))


# ------------------------------------------------------------------ CUDA kernels by name
_FUNCTOR = re.compile(r"(OP_\w+|\w+Ops(?=<)|\w*(?:Functor|Impl|_kernel_cuda)\w*)")
_WRAPPER = re.compile(r"^Kernel\d*$")  # cutlass::Kernel<...>: the name that says what runs is its argument
_IDENT = re.compile(r"[A-Za-z_]\w{3,}")


def kernel_family(name: str) -> str:
    """A kernel's name without its return type, namespaces, template arguments and parameters; a generic wrapper
    keeps what says what it computes: "vectorized_elementwise_kernel[GeluCUDAKernelImpl]", the cutlass kernel
    inside cutlass::Kernel2<...>."""
    name = name.removeprefix("void ").strip()
    cut = min((i for i in (name.find("<"), name.find("(")) if i > 0), default=len(name))
    base, rest = name[:cut], name[cut:]
    base = base.split("::")[-1] or base
    if _WRAPPER.match(base) and (m := _IDENT.search(rest)):
        base = m.group(0)
    elif any(w in base.lower() for w in ("elementwise", "reduce")) and (m := _FUNCTOR.search(rest)):
        base = f"{base}[{m.group(1)}]"
    return base[:96]


def kernel_totals(events: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Total device ms per kernel family from Chrome-trace events (Kineto's "kernel" category, dur in us)."""
    totals: dict[str, float] = {}
    for ev in events:
        if ev.get("cat") == "kernel":
            fam = kernel_family(str(ev.get("name", "?")))
            totals[fam] = totals.get(fam, 0.0) + float(ev.get("dur", 0)) / 1000.0
    return totals


def cuda_kernel_times(fn: Callable[[], Any], calls: int = 3) -> dict[str, float]:
    """Totals per kernel family over `calls` calls of fn under CUPTI; {} where CUDA cannot be traced (the stage's
    cuda_kernels counts say why)."""
    from optimizer.runtime.gpu import cuda_reason

    if cuda_reason() is not None:
        return {}
    from optimizer.runtime.gpu.kernels import trace_events

    try:
        return kernel_totals(trace_events(fn, calls, cuda=True))
    except Exception:  # CUPTI missing or busy: profile_kernels records the reason for the same stage
        return {}


# ------------------------------------------------------------------ generation: prefill and decode step
@dataclass
class GenerationProfile:
    prefill: OpProfile
    decode: OpProfile  # per decode step
    source: str  # "onnxruntime" | "torch"


def decode_per_step(whole: Mapping[str, float], prefill: Mapping[str, float], steps: int) -> dict[str, float]:
    """(one whole generation - one prefill-only generation) / its decode steps, per name; a name whose difference
    is noise below zero is dropped."""
    out = {k: (v - prefill.get(k, 0.0)) / max(steps, 1) for k, v in whole.items()}
    return {k: v for k, v in sorted(out.items(), key=lambda kv: -kv[1]) if v >= MIN_MS}


def _differenced(generate: Callable[[int], Any], new: int, reps: int, run: Callable[..., Any]) -> tuple[Any, Any]:
    """run(fn, reps) on prefill-only generations and on whole ones."""
    return run(lambda: generate(1), reps), run(lambda: generate(new), reps)


def _ort_generation(artifact: Artifact, recipe: Recipe, prompt: np.ndarray, new: int, reps: int) -> GenerationProfile:
    """The prefill and the decode session each profiled by ONNX Runtime over `reps` + 1 whole generations: per op
    type, the median over the prefill calls and over the decode steps, each session's first run left out
    (runtime.runners.ort_runner.profile_per_run)."""
    import tempfile

    from optimizer.runtime.runners.gen_runner import ort_loop
    from optimizer.runtime.runners.ort_runner import profile_runs
    from optimizer.runtime.sessions import ort_session
    from optimizer.runtime.threads import target_threads

    decode = artifact.decode_path()
    assert artifact.path is not None and decode is not None
    device = recipe.target.device
    runtime = {**artifact.runtime, "cuda_graph": False}
    with tempfile.TemporaryDirectory() as tmp:
        sessions = [
            ort_session(p, runtime, target_threads(recipe), device, profile_prefix=str(Path(tmp) / name))
            for p, name in ((artifact.path, "prefill"), (decode, "decode"))
        ]
        layers = artifact.decoder_layers()
        gen = ort_loop(*sessions, layers, device)  # a decoder's loop, or an encoder-decoder's
        for _ in range(reps + 1):  # the first generation warms both sessions up
            gen.generate(prompt, new, keep_logits=False)
        pre, dec = (ort_op_profile(profile_runs(json.loads(Path(s.end_profiling()).read_text()))) for s in sessions)
    dec.nodes = dec.nodes or None
    return GenerationProfile(pre, dec, "onnxruntime")


def _genai_generation(artifact: Artifact, recipe: Recipe, prompt: np.ndarray, new: int, reps: int) -> GenerationProfile:
    """A GenAI-layout decoder: one session serves prefill and decode, so its runs are split by their place in each
    generation (the first of every `new` runs is the prefill), then profiled as the two sessions are above."""
    import tempfile

    from optimizer.runtime.runners.gen_runner import genai_generator
    from optimizer.runtime.runners.ort_runner import profile_runs

    with tempfile.TemporaryDirectory() as tmp:
        gen = genai_generator(artifact, recipe, profile_prefix=str(Path(tmp) / "genai"))
        for _ in range(reps + 1):
            gen.generate(prompt, new, keep_logits=False)
        events = json.loads(Path(gen.session.end_profiling()).read_text())
    runs = sorted((ev for ev in events if ev.get("name") == "model_run"), key=lambda ev: ev["ts"])
    others = [ev for ev in events if ev.get("name") != "model_run"]
    prefill_runs = [ev for k, ev in enumerate(runs) if k % max(new, 1) == 0]
    decode_runs = [ev for k, ev in enumerate(runs) if k % max(new, 1) != 0]
    pre = ort_op_profile(profile_runs(prefill_runs + others))
    dec = ort_op_profile(profile_runs(decode_runs + others)) if decode_runs else OpProfile()
    dec.nodes = dec.nodes or None
    return GenerationProfile(pre, dec, "onnxruntime")


def generation_profile(
    artifact: Artifact, recipe: Recipe, gen: Any, prompt: np.ndarray, new: int, reps: int = 3
) -> GenerationProfile:
    """Op types of one prefill and of one decode step, from `reps` generations of `new` tokens from `prompt` (the
    PyTorch loop: per name, the median over generations; ONNX Runtime: over the calls of each session);
    on CUDA also kernel time per name, from the timed generator `gen`."""
    cuda = recipe.target.device == "cuda"
    steps = max(new - 1, 0)  # decode steps per generation; 0: none to profile

    def generate(n: int) -> Any:
        return gen.generate(prompt, n, keep_logits=False)

    if artifact.kind == "torch":
        (pre_ops, pre_k), (all_ops, all_k) = _differenced(generate, new, reps, lambda f, c: profile_torch(f, c, cuda))
        if artifact.runtime.get("cuda_graph"):  # the decode step replays a graph: no aten op to see, kernels only
            all_ops = pre_ops
        return GenerationProfile(
            OpProfile(_sorted(pre_ops, 1), _sorted(pre_k, 1)),
            OpProfile(decode_per_step(all_ops, pre_ops, steps), decode_per_step(all_k, pre_k, steps))
            if steps
            else OpProfile(),
            "torch",
        )
    if artifact.kind == "onnx" and artifact.genai_files:
        prof = _genai_generation(artifact, recipe, prompt, new, reps)
    elif artifact.kind == "onnx":
        prof = _ort_generation(artifact, recipe, prompt, new, reps)
    else:
        prof = GenerationProfile(OpProfile(), OpProfile(), "")
    if cuda:
        pre_k, all_k = _differenced(generate, new, reps, cuda_kernel_times)
        pre_k, all_k = ({k: v / reps for k, v in d.items()} for d in (pre_k, all_k))
        prof.prefill.kernels = _sorted(pre_k, 1)
        prof.decode.kernels = decode_per_step(all_k, pre_k, steps) if steps else {}
    return prof
