"""Measuring one stage: load it, check its outputs against stage 0, time it interleaved with its parent.

This is the only place that times anything; passes never measure themselves. Memory is the growth of the
process's resident set while the stage is loaded and warmed up (the stage is loaded before its parent so
the parent's memory is not counted): it is an estimate, and is labelled as such in the report.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.core.metrics import (
    CudaKernels,
    InputsMix,
    Latency,
    MachineLoad,
    Memory,
    NvmlSummary,
    ScenarioMetrics,
    StageMetrics,
    Throughput,
    Transfers,
)
from optimizer.measure.accuracy import AccuracyMeter, Verdict, mask_of, recipe_verdict
from optimizer.measure.bench_slot import bench_slot
from optimizer.measure.denormal_probe import probe_denormals, probe_reason
from optimizer.measure.harness import Timed, instances_for, measure, twins_refused, warm_up_all
from optimizer.measure.machine import LoadSampler
from optimizer.measure.phases import PhaseClock
from optimizer.measure.profiles import OpProfile, cuda_kernel_times, ort_op_profile, scenario_profile, torch_profile
from optimizer.measure.stats import instance_variance, latency_stats, median_ci_halfwidth, speedup
from optimizer.recipe.schema import Recipe
from optimizer.runtime.gpu.memory import GpuMemoryProbe
from optimizer.runtime.gpu.nvml import NvmlSampler
from optimizer.runtime.inputs import Feed, FeedSet, ScenarioFeeds
from optimizer.runtime.runners import runner_for
from optimizer.runtime.runners.base import Session

# Part of every cached measurement's key: bump it when what is measured changes, so old numbers are redone.
MEASURE_VERSION = 18  # 10: every sample timed in turn, accuracy on kept positions, tail intervals; 11: settle;
# 12: op-type profiles of PyTorch stages and of the prefill, kernel time per name on CUDA; 13, 14: every scenario
# profiled, with ORT's slowest nodes by name; 15: generation stages profiled per scenario, TPOT ratio
# interleaved; 16: twin sessions a side, the ratio's interval includes the instance spread; 17: denormal probe;
# 18: the accuracy figure's interval (the budget's edge)

Reference = dict[str, list[list[np.ndarray]]]  # scenario -> samples -> outputs
Progress = Callable[[str, int, int], None]


def latency_of(samples_ms: list[float] | np.ndarray) -> Latency:
    """The samples' Latency (measure.stats.latency_stats), as the metrics hold them."""
    return latency_stats(samples_ms)


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def stage_memory(artifact: Artifact, recipe: Recipe, inline_mb: float) -> tuple[float, dict[str, Any]]:
    """The stage's host memory (MB) and how it was measured: a fresh-process probe (optimizer/measure/memprobe.py) by
    default; the in-process growth when the recipe asks for it or the probe cannot run (with the reason)."""
    detail: dict[str, Any] = {"inline_mb": round(inline_mb, 1)}
    if recipe.benchmark.memory == "process":
        from optimizer.measure.memprobe import probe

        result = probe(artifact, recipe)
        if "peak_mb" in result:
            return float(result["peak_mb"]), {"method": "process", **result, **detail}
        detail["reason"] = result["reason"]
    return inline_mb, {"method": "inline", **detail}


def run_all(session: Session, feeds: FeedSet) -> Reference:
    return {sf.scenario.name: [session.to_numpy(session.run(session.prepare(f))) for f in sf.samples] for sf in feeds}


def _accuracy(session: Session, feeds: FeedSet, reference: Reference) -> dict[str, Any]:
    outputs = run_all(session, feeds)
    names = session.output_names
    meter = AccuracyMeter(names)
    for sf in feeds:
        for ref, got, feed in zip(reference[sf.scenario.name], outputs[sf.scenario.name], sf.samples, strict=True):
            meter.add(ref, got, mask_of(feed))
    return meter.to_json()


def _throughput(recipe: Recipe, scenario_name: str, mean_ms: float) -> Throughput:
    scen = next(s for s in recipe.scenarios if s.name == scenario_name)
    per_s = 1000.0 / mean_ms if mean_ms > 0 else 0.0
    return Throughput(samples_per_s=scen.batch * per_s, tokens_per_s=scen.batch * scen.seq * per_s)


PROFILED_CALLS = 10


def _op_profiles(
    artifact: Artifact, recipe: Recipe, session: Session, feeds: FeedSet, prepared: dict[str, list[Any]]
) -> dict[str, tuple[OpProfile, str | None]]:
    """Per scenario, time per op type of one call on its timing input (per op type, the median of the profiled
    calls after a warm-up), from the stage's own runtime: ONNX Runtime's profiler (one separate, profiled session
    for every scenario's feed: profiling adds overhead, so its numbers never mix with the timed ones; with its
    slowest nodes by name) or the PyTorch profiler (on the timed session, after the timing); on CUDA also the
    device time per kernel name (CUPTI), for any runtime. With each, the profiler's name, or None when nothing
    profiled op types."""
    cuda = recipe.target.device == "cuda"
    names = [sf.scenario.name for sf in feeds]
    out: dict[str, tuple[OpProfile, str | None]] = {}
    if artifact.kind == "onnx":
        from optimizer.runtime.runners.ort_runner import profile_feeds

        runs = profile_feeds(artifact, recipe, [sf.timing for sf in feeds], runs=PROFILED_CALLS)
        out = {name: (ort_op_profile(prof), "onnxruntime") for name, prof in zip(names, runs, strict=True)}
    if artifact.kind == "openvino":  # OpenVINO's performance counters, per layer type
        from optimizer.runtime.runners.ov_runner import ov_profile

        runs = ov_profile(artifact, recipe, [sf.timing for sf in feeds], runs=PROFILED_CALLS)
        out = {name: (ort_op_profile(prof), "openvino") for name, prof in zip(names, runs, strict=True)}
    for name in names:
        call = prepared[name][0]
        if artifact.kind == "torch":
            profile = torch_profile(lambda p=call: session.run(p), PROFILED_CALLS, cuda)
            # a replayed CUDA graph runs no aten op the profiler sees: kernels only
            out[name] = (OpProfile(kernels=profile.kernels), None) if artifact.runtime.get("cuda_graph") else (
                profile, "torch")
            continue
        profile, source = out.get(name, (OpProfile(), None))
        if cuda:
            calls = 3
            times = cuda_kernel_times(lambda p=call: session.run(p), calls)
            profile.kernels = {k: v / calls for k, v in times.items()}
        out[name] = (profile, source)
    return out


def _load_twins(
    stack: ExitStack, artifact: Artifact, parent: Artifact | None, recipe: Recipe
) -> tuple[list[Session], list[Session], str | None]:
    """`benchmark.instances - 1` more sessions of the stage and of its parent (none without a parent), or none and
    why when they cannot load (memory: a GPU that holds one engine a side may not hold two)."""
    copies = instances_for(recipe.benchmark) - 1
    if parent is None or copies < 1:
        return [], [], None
    twins = ExitStack()
    try:
        child = [twins.enter_context(runner_for(artifact, recipe).load()) for _ in range(copies)]
        parents = [twins.enter_context(runner_for(parent, recipe).load()) for _ in range(copies)]
    except Exception as e:  # out of memory, of any library: the stage is still timed, one session a side
        twins.close()
        return [], [], twins_refused(copies, e)
    stack.enter_context(twins)
    return child, parents, None


def _twins(sessions: list[Session], samples: list[Feed], warmup: int) -> list[tuple[Session, list[Any]]]:
    """Each twin session with its own prepared inputs, warmed like the first instance."""
    out = []
    for twin in sessions:
        inputs = [twin.prepare(f) for f in samples]
        warm_up_all(twin, inputs, warmup)
        out.append((twin, inputs))
    return out


def _load(stack: ExitStack, artifact: Artifact, recipe: Recipe, feeds: FeedSet
          ) -> tuple[Session, dict[str, list[Any]], float, float | None, str | None]:
    """The stage's session (on `stack`), its inputs prepared per scenario and warmed up, and the memory that took:
    (session, prepared, host MB grown, GPU MB, how the GPU figure was read)."""
    before = _rss()
    gpu_probe = GpuMemoryProbe(recipe.target.device).start()
    session = stack.enter_context(runner_for(artifact, recipe).load())
    prepared = {sf.scenario.name: [session.prepare(f) for f in sf.samples] for sf in feeds}
    for name in prepared:
        warm_up_all(session, prepared[name], recipe.benchmark.warmup)
    memory_mb = (_rss() - before) / 2**20
    gpu_memory_mb, gpu_memory_method = gpu_probe.result()
    return session, prepared, memory_mb, gpu_memory_mb, gpu_memory_method


def _check(session: Session, feeds: FeedSet, reference: Reference | None, recipe: Recipe
           ) -> tuple[dict[str, Any], Verdict, Reference | None, int | None]:
    """Accuracy against stage 0 (reference=None: this is stage 0, its outputs become the reference): (accuracy,
    the budget's verdict, the new reference or None, stage 0's own NaN/inf count or None)."""
    new_reference = run_all(session, feeds) if reference is None else None
    # Stage 0's own NaN/inf: every later stage is compared against them (NaN agrees with NaN), so say so.
    nonfinite_reference = (
        sum(int(np.sum(~np.isfinite(o))) for s in new_reference.values() for outs in s for o in outs
            if np.issubdtype(o.dtype, np.floating))
        if new_reference is not None
        else None
    )
    accuracy = _accuracy(session, feeds, reference if reference is not None else new_reference)  # type: ignore[arg-type]
    return accuracy, recipe_verdict(accuracy, recipe), new_reference, nonfinite_reference


def _time_scenario(session: Session, child: Timed, other: Timed | None, recipe: Recipe, sf: ScenarioFeeds,
                   tick: Callable[[int, Any], None]) -> ScenarioMetrics:
    """One scenario timed (harness.measure: the one loop) and its figures: latency over the mix, throughput, on
    a GPU the device time, copies, NVML and kernels; against the parent the interleaved ratio and the spread
    between instances. tick(round, NVML sampler or None) between rounds."""
    settings = recipe.benchmark
    name = sf.scenario.name
    with NvmlSampler() if recipe.target.device == "cuda" else nullcontext() as sampler:
        measure(child, other, settings, lambda r: tick(r, sampler))
    stats = latency_of(child.samples())
    entry = ScenarioMetrics(
        latency=stats,
        throughput=_throughput(recipe, name, stats.mean_ms),
        iterations=len(child.samples()),
        rounds=len(child.rounds),
        median_ci_halfwidth=median_ci_halfwidth(child.samples()),
        # the mix the latency was taken over
        inputs=InputsMix.model_validate(sf.lengths() or {"samples": len(sf.samples)}),
        # Kept so that runs can be compared later (optimizer diff) with their real spread.
        samples_ms=[round(x, 4) for x in child.samples()],
    )
    if child.device_rounds:  # GPU stages: compute time apart from host latency and from copies
        entry.gpu_latency = latency_of([x for r in child.device_rounds for x in r])
        entry.transfers = Transfers.model_validate(session.transfer_ms(sf.timing))  # type: ignore[attr-defined]
        entry.nvml = NvmlSummary.model_validate(sampler.summary() if sampler is not None else {})
    if recipe.target.device == "cuda":  # kernels run and host launches per call (any runtime, via CUPTI)
        from optimizer.runtime.gpu.kernels import profile_kernels

        counts = profile_kernels(lambda p=child.inputs[0]: session.run(p))
        entry.cuda_kernels = CudaKernels.model_validate(counts)
    if other is not None:
        entry.parent_latency = latency_of(other.samples())
        entry.vs_parent = speedup(other.rounds, child.rounds, settings.confidence)
        spread = instance_variance(other.rounds, child.rounds, other.instance_rounds, child.instance_rounds)
        if spread is not None:  # the interval is widened by the run's pooled spread (measure.instances)
            entry.instance_variance, entry.instance_df = spread.variance, spread.df
            entry.instance_factor = spread.factor
    return entry


def _time(
    stack: ExitStack,
    session: Session,
    prepared: dict[str, list[Any]],
    artifact: Artifact,
    parent: Artifact | None,
    recipe: Recipe,
    feeds: FeedSet,
    progress: Progress,
    label: str,
) -> tuple[dict[str, ScenarioMetrics], MachineLoad | None, str | None]:
    """The parent and the twins loaded (on `stack`), then every scenario timed in the host's bench slot, then the
    denormal probe: (per scenario metrics, other processes' load meanwhile, why twins were refused or None)."""
    settings = recipe.benchmark
    parent_session = stack.enter_context(runner_for(parent, recipe).load()) if parent else None
    # Twins: more sessions of the stage and of its parent, timed in turn (measure.harness), loaded after the
    # memory reading so that it stays one session's, and prepared and warmed before the bench slot.
    child_twins, parent_twins, twin_note = _load_twins(stack, artifact, parent, recipe)
    twin_inputs = {
        sf.scenario.name: (_twins(child_twins, sf.samples, settings.warmup),
                           _twins(parent_twins, sf.samples, settings.warmup))
        for sf in feeds
    }
    scenarios: dict[str, ScenarioMetrics] = {}
    total, done = len(prepared) * settings.rounds, 0
    with bench_slot(f"{label} timing"):
        with LoadSampler() as load:
            for sf in feeds:
                name = sf.scenario.name
                child = Timed(session, prepared[name], twins=twin_inputs[name][0])
                other = None
                if parent_session is not None:
                    other = Timed(
                        parent_session, [parent_session.prepare(f) for f in sf.samples], twins=twin_inputs[name][1]
                    )
                    warm_up_all(parent_session, other.inputs, settings.warmup)

                def tick(r: int, nvml: Any, base: int = done, scen: str = name) -> None:
                    if nvml is not None:  # between rounds: no sampling thread contends with the timed calls
                        nvml.sample()
                    progress(f"timing {scen}", base + r, total)

                scenarios[name] = _time_scenario(session, child, other, recipe, sf, tick)
                done += settings.rounds
        if probe_reason(artifact, recipe) is None:  # the same stage with denormals flushed, briefly, interleaved
            progress("probing denormals", 0, 0)
            for scen_name, vs_flushed in probe_denormals(artifact, recipe, session, feeds, prepared).items():
                scenarios[scen_name].denormal_probe = vs_flushed
    return scenarios, MachineLoad.model_validate(load.result) if load.result else None, twin_note


def _profile(artifact: Artifact, recipe: Recipe, session: Session, feeds: FeedSet, prepared: dict[str, list[Any]],
             scenarios: dict[str, ScenarioMetrics], progress: Progress, label: str) -> tuple[OpProfile, str | None]:
    """Every scenario's op-type profile onto its ScenarioMetrics, in the bench slot; returns the first
    scenario's (the stage-level fields) with its profiler's name."""
    progress("profiling op types", 0, 0)
    with bench_slot(f"{label} profile"):  # profiled calls are timings too
        profiles = _op_profiles(artifact, recipe, session, feeds, prepared)
    for scen_name, (scen_profile, scen_source) in profiles.items():
        scenarios[scen_name].profile = scenario_profile(scen_profile, scen_source)
    return profiles[next(iter(feeds)).scenario.name]


def measure_stage(
    artifact: Artifact,
    parent: Artifact | None,
    recipe: Recipe,
    feeds: FeedSet,
    reference: Reference | None,
    progress: Progress,
    label: str = "stage",
) -> tuple[dict[str, Any], Reference | None]:
    """Metrics of one stage (load, accuracy, time, profile, memory), built as core.metrics.StageMetrics and
    returned as its JSON (what the engine adds the graph facts to and caches in metrics.json). With
    reference=None the stage is stage 0 and its outputs become the reference. The host's bench slot is held only
    while something is timed ("<label> timing", "<label> profile"): loading, the accuracy run and the memory
    probe may overlap other compiles' build work."""
    gc.collect()
    clock = PhaseClock()
    with ExitStack() as stack:
        session, prepared, memory_mb, gpu_memory_mb, gpu_memory_method = _load(stack, artifact, recipe, feeds)
        clock.lap("load")
        accuracy, verdict, new_reference, nonfinite_reference = _check(session, feeds, reference, recipe)
        clock.lap("accuracy")
        scenarios, load, twin_note = _time(stack, session, prepared, artifact, parent, recipe, feeds, progress, label)
        clock.lap("time")
        profile, source = _profile(artifact, recipe, session, feeds, prepared, scenarios, progress, label)
        clock.lap("profile")
        progress("measuring memory", 0, 0)
        memory_mb, memory = stage_memory(artifact, recipe, memory_mb)
        clock.lap("memory")
        metrics = StageMetrics(
            op_time_ms=profile.ops,  # per run, first scenario's timing input, from the runtime's own profiler
            op_time_source=source,
            kernel_time_ms=profile.kernels,  # CUDA: device ms per kernel name per call (CUPTI)
            nodes_executed=profile.nodes,  # kernels ORT ran per call (after its own fusions)
            runtime=session.describe(),
            memory_mb=memory_mb,
            memory=Memory.model_validate(memory),
            gpu_memory_mb=gpu_memory_mb,  # what the stage's runtime took on the device (runtime.gpu.memory)
            gpu_memory_method=gpu_memory_method,
            accuracy=accuracy,
            within_budget=verdict.within,
            budget=verdict.why,
            budget_edge=verdict.edge,
            scenarios=scenarios,
            # other processes' CPU, steal, load average while this stage was timed
            machine_load=load,
            nonfinite_reference=nonfinite_reference,  # stage 0 only: NaN/inf in the reference outputs
            phase_seconds=clock.seconds,
            **({"instance_note": twin_note} if twin_note else {}),
        )
    return metrics.to_json(), new_reference
