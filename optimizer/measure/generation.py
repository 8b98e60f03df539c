"""Measuring a generation stage: whole greedy generations, interleaved with the parent round by round.

Per scenario (prompt = seq tokens, new_tokens generated): time to first token, time per output token (every
decode step of every timed generation), end-to-end task time and tokens/s. Accuracy against stage 0: greedy
token agreement over the generated tokens and the logits cosine step by step (optimizer/generation.py).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.core.metrics import (
    CudaKernels,
    MachineLoad,
    Memory,
    OutputAccuracy,
    ScenarioMetrics,
    Speedup,
    StageMetrics,
    Throughput,
)
from optimizer.measure.accuracy import generation_agreement as agreement
from optimizer.measure.bench_slot import bench_slot
from optimizer.measure.forward import Progress, Reference, _rss, latency_of, stage_memory
from optimizer.measure.harness import instance_for, instances_for, twins_refused
from optimizer.measure.profiles import generation_profile, scenario_profile
from optimizer.measure.stats import instance_variance, median_ci_halfwidth, speedup
from optimizer.recipe.schema import Recipe
from optimizer.runtime.generation import Generation
from optimizer.runtime.gpu.memory import GpuMemoryProbe
from optimizer.runtime.inputs import FeedSet
from optimizer.runtime.runners.gen_runner import generator_for

SETTLE_PROMPT = 8  # tokens of the untimed generation that settles a switch between sides


def _as_reference(g: Generation) -> list[np.ndarray]:
    return [g.tokens, np.stack(g.step_logits)]


def _from_reference(arrays: list[np.ndarray]) -> Generation:
    return Generation(arrays[0], list(arrays[1]))


def _loose(child_rounds: list[list[Generation]], r: int, settings: Any) -> bool:
    """benchmark.target_ci: keep adding rounds until the task time's median is pinned down (or max_rounds)."""
    e2e = [g.e2e_ms for rnd in child_rounds for g in rnd]
    return settings.target_ci > 0 and r < settings.max_rounds and median_ci_halfwidth(e2e) > settings.target_ci


def timed_generation_rounds(
    sides: list[tuple[str, list[Any]]],
    prompts: list[np.ndarray],
    new: int,
    settings: Any,
    on_round: Callable[[int], None] | None = None,
) -> tuple[dict[str, list[list[Generation]]], dict[str, list[int]], int]:
    """Interleaved rounds of whole generations, ABBA, twins taken in turn (measure.harness.instance_for). Each
    switch between sides settles as forward timing does: `settle_ms` asleep (the other side's pool threads stop
    spinning) and one short untimed generation on the generator about to be timed (its weights back in cache).
    Without it the side timed second paid for the first one's spinning threads: two identical graphs then read
    as one slower than the other. Returns (generations per side per round, generator used per round, rounds)."""
    runs: dict[str, list[list[Generation]]] = {name: [] for name, _ in sides}
    used: dict[str, list[int]] = {name: [] for name, _ in sides}
    child_count = len(dict(sides)["child"])
    r = 0
    while r < settings.rounds or _loose(runs["child"], r, settings):
        for name, gens in sides if r % 2 == 0 else sides[::-1]:
            k = instance_for(r, name == "child", child_count, len(gens))
            used[name].append(k)
            if len(sides) > 1:
                time.sleep(settings.settle_ms / 1000)
                first = prompts[(r * settings.iterations) % len(prompts)]
                gens[k].generate(first[:, : min(SETTLE_PROMPT, first.shape[1])], min(2, new), keep_logits=False)
            runs[name].append(
                [
                    gens[k].generate(prompts[(r * settings.iterations + i) % len(prompts)], new, keep_logits=False)
                    for i in range(settings.iterations)
                ]
            )
        r += 1
        if on_round:
            on_round(r)
    return runs, used, r


def measure_generation_stage(
    artifact: Artifact,
    parent: Artifact | None,
    recipe: Recipe,
    feeds: FeedSet,
    reference: Reference | None,
    progress: Progress,
    label: str = "stage",
) -> tuple[dict[str, Any], Reference | None]:
    """The host's bench slot is held only while something is timed ("<label> timing", "<label> profile"): the
    accuracy generations, loading and the memory probe may overlap other compiles' build work."""
    settings = recipe.benchmark
    gc.collect()
    before = _rss()
    gpu_probe = GpuMemoryProbe(recipe.target.device).start()
    gen = generator_for(artifact, recipe)
    outputs: Reference = {}
    for sf in feeds:
        outputs[sf.scenario.name] = [
            _as_reference(gen.generate(f["input_ids"], sf.scenario.new_tokens)) for f in sf.samples
        ]
    memory_mb = (_rss() - before) / 2**20
    gpu_memory_mb, gpu_memory_method = gpu_probe.result()
    new_reference = outputs if reference is None else None
    ref = reference if reference is not None else outputs
    worst: dict[str, float] = {"token_agreement": 1.0, "cosine": 1.0, "logits_cosine_min": 1.0}
    for scen, samples in outputs.items():
        for expected, got in zip(ref[scen], samples, strict=True):
            a = agreement(_from_reference(expected), _from_reference(got))
            worst["token_agreement"] = min(worst["token_agreement"], a["token_agreement"])
            worst["cosine"] = min(worst["cosine"], a["logits_cosine_before_divergence"])
            worst["logits_cosine_min"] = min(worst["logits_cosine_min"], a["logits_cosine_min"])
    accuracy = {"generation": worst}
    from optimizer.measure.accuracy import recipe_verdict

    within, why, _ = recipe_verdict(accuracy, recipe)  # no interval: token agreement is judged as measured
    parent_gen = generator_for(parent, recipe) if parent is not None else None
    # Twins: more generators of the stage and of its parent, taken in turn by round (measure.harness)
    child_gens, parent_gens, twin_note = [gen], [parent_gen] if parent_gen is not None else [], None
    copies = instances_for(settings) - 1
    if parent is not None and copies > 0:
        try:
            child_gens += [generator_for(artifact, recipe) for _ in range(copies)]
            parent_gens += [generator_for(parent, recipe) for _ in range(copies)]
        except Exception as e:  # out of memory, of any library: timed with one generator a side
            child_gens, parent_gens = [gen], [parent_gen]
            twin_note = twins_refused(copies, e)
    scenarios: dict[str, ScenarioMetrics] = {}
    total = len(recipe.scenarios) * settings.rounds
    done = 0
    from optimizer.measure.machine import LoadSampler

    with bench_slot(f"{label} timing"):  # warm-up and the interleaved rounds
        load = LoadSampler().__enter__()
        for sf in feeds:
            prompt, new = sf.timing["input_ids"], sf.scenario.new_tokens
            prompts = [f["input_ids"] for f in sf.samples]  # timed in turn, parent and child on the same prompt
            sides = [("child", child_gens)] + ([("parent", parent_gens)] if parent_gen is not None else [])
            for _, gens in sides:  # at least once: a CUDA-graph stage captures its decode step on its first run
                for g in gens:
                    for _ in range(max(1, min(settings.warmup, 2))):
                        g.generate(prompt, new, keep_logits=False)
            def on_round(_: int, name: str = sf.scenario.name) -> None:
                nonlocal done
                done += 1
                progress(f"generating {name}", done, total)

            runs, used, r = timed_generation_rounds(sides, prompts, new, settings, on_round)
            child = [g for rnd in runs["child"] for g in rnd]
            e2e = latency_of([g.e2e_ms for g in child])
            batch = sf.scenario.batch
            entry = ScenarioMetrics(
                latency=e2e,
                ttft=latency_of([g.ttft_ms for g in child]),
                tpot=latency_of([t for g in child for t in g.tpot_ms] or [0.0]),
                throughput=Throughput(
                    tokens_per_s=batch * new * 1000 / e2e.mean_ms,
                    samples_per_s=batch * 1000 / e2e.mean_ms,
                ),
                iterations=len(child),
                rounds=r,
                prompt_tokens=int(prompt.shape[1]),
                new_tokens=new,
                samples_ms=[round(g.e2e_ms, 4) for g in child],
            )
            if parent_gen is not None:
                p_rounds = [[g.e2e_ms for g in rnd] for rnd in runs["parent"]]
                c_rounds = [[g.e2e_ms for g in rnd] for rnd in runs["child"]]
                entry.parent_latency = latency_of([x for rnd in p_rounds for x in rnd])
                parent_runs = [g for rnd in runs["parent"] for g in rnd]  # for the explanation per prefill and step
                entry.parent_ttft = latency_of([g.ttft_ms for g in parent_runs])
                entry.parent_tpot = latency_of([t for g in parent_runs for t in g.tpot_ms] or [0.0])
                entry.vs_parent = Speedup.model_validate(speedup(p_rounds, c_rounds, settings.confidence).to_json())
                spread = instance_variance(p_rounds, c_rounds, used["parent"], used["child"])
                if spread is not None:  # widened by the run's pooled spread (measure.instances)
                    entry.instance_variance, entry.instance_df = spread.variance, spread.df
                    entry.instance_factor = spread.factor
                # per round, each generation's median time per token: TPOT's own interleaved ratio and interval
                tp = [[float(np.median(g.tpot_ms)) for g in rnd if g.tpot_ms] for rnd in runs["parent"]]
                tc = [[float(np.median(g.tpot_ms)) for g in rnd if g.tpot_ms] for rnd in runs["child"]]
                if all(tp) and all(tc):
                    entry.tpot_vs_parent = Speedup.model_validate(speedup(tp, tc, settings.confidence).to_json())
                    spread = instance_variance(tp, tc, used["parent"], used["child"])
                    if spread is not None:
                        entry.tpot_instance_variance, entry.tpot_instance_df = spread.variance, spread.df
            if recipe.target.device == "cuda":  # per whole task (prefill + new_tokens - 1 decode steps)
                from optimizer.runtime.gpu.kernels import profile_kernels

                counts = profile_kernels(lambda g=gen, p=prompt, n=new: g.generate(p, n, False), calls=1)
                entry.cuda_kernels = CudaKernels.model_validate(counts)
            scenarios[sf.scenario.name] = entry
        load.__exit__(None, None, None)
    runtime = {
        "runtime": "pytorch" if artifact.kind == "torch" else "onnxruntime",
        "device": recipe.target.device,
        "loop": "greedy, KV cache, fixed new_tokens, each token copied to the host as produced",
        "kv_cache": "dynamic",
        **artifact.runtime,
        **(gen.describe() if hasattr(gen, "describe") else {}),
    }
    progress("profiling the prefill and the decode step", 0, 0)
    first = next(iter(feeds))
    with bench_slot(f"{label} profile"):  # profiled calls are timings too
        by_scenario = {  # every scenario's prefill and decode step: a long prompt changes where the time goes
            sf.scenario.name: generation_profile(artifact, recipe, gen, sf.timing["input_ids"], sf.scenario.new_tokens)
            for sf in feeds
        }
    for name, p in by_scenario.items():
        scenarios[name].profile = scenario_profile(p.decode, p.source or None, p.prefill)
    prof = by_scenario[first.scenario.name]
    progress("measuring memory", 0, 0)
    memory_mb, memory = stage_memory(artifact, recipe, memory_mb)
    metrics = StageMetrics(
        workload="generation",
        runtime=runtime,
        memory_mb=memory_mb,
        memory=Memory.model_validate(memory),
        gpu_memory_mb=gpu_memory_mb,
        gpu_memory_method=gpu_memory_method,
        accuracy={name: OutputAccuracy.model_validate(a) for name, a in accuracy.items()},
        within_budget=within,
        budget=why,
        scenarios=scenarios,
        machine_load=MachineLoad.model_validate(load.result) if load.result else None,
        # first scenario's prompt and new_tokens, from the runtime's own profiler (measure.profiles)
        op_time_ms=prof.decode.ops,  # per decode step
        prefill_op_time_ms=prof.prefill.ops,  # one prefill call
        op_time_source=prof.source or None,
        kernel_time_ms=prof.decode.kernels,  # CUDA: device ms per kernel name (CUPTI)
        prefill_kernel_time_ms=prof.prefill.kernels,
        nodes_executed=prof.decode.nodes,  # ONNX Runtime: node kernels per decode step
        **({"instance_note": twin_note} if twin_note else {}),
    )
    return metrics.to_json(), new_reference  # StageMetrics' JSON, as measure_stage returns it

