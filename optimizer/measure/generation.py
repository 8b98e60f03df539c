"""Measuring a generation stage: whole greedy generations, interleaved with the parent round by round.

Per scenario (prompt = seq tokens, new_tokens generated): time to first token, time per output token (every
decode step of every timed generation), end-to-end task time and tokens/s. Accuracy against stage 0: greedy
token agreement over the generated tokens and the logits cosine step by step (measure.accuracy.generation_agreement).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.core.metrics import (
    CudaKernels,
    MachineLoad,
    Memory,
    OutputAccuracy,
    ScenarioMetrics,
    StageMetrics,
    Throughput,
)
from optimizer.measure import harness
from optimizer.measure.accuracy import generation_agreement as agreement
from optimizer.measure.bench_slot import bench_slot
from optimizer.measure.forward import Progress, Reference, _rss, latency_of, stage_memory
from optimizer.measure.harness import instances_for, twins_refused
from optimizer.measure.phases import PhaseClock
from optimizer.measure.profiles import generation_profile, scenario_profile
from optimizer.measure.stats import instance_variance, speedup
from optimizer.recipe.schema import Recipe
from optimizer.runtime.generation import Generation
from optimizer.runtime.gpu.memory import GpuMemoryProbe
from optimizer.runtime.inputs import FeedSet
from optimizer.runtime.runners.gen_runner import generator_for
from optimizer.runtime.seq2seq import prompt_of

SETTLE_PROMPT = 8  # tokens of the untimed generation that settles a switch between sides


def _as_reference(g: Generation) -> list[np.ndarray]:
    return [g.tokens, np.stack(g.step_logits)]


def _from_reference(arrays: list[np.ndarray]) -> Generation:
    return Generation(arrays[0], list(arrays[1]))


@dataclass
class GenerationSide:
    """One side of generation timing as harness.interleave drives it: generators of one artifact (instances),
    `calls` whole greedy generations a round on the prompts in turn (from r x calls), each a Generation with its
    TTFT, TPOT and task time. Settling is a short untimed generation (SETTLE_PROMPT tokens of the round's first
    prompt, 2 new) on the generator about to be timed: its weights back in cache."""

    gens: list[Any]
    prompts: list[np.ndarray]
    new: int
    calls: int
    rounds: list[list[Generation]] = field(default_factory=list)
    instance_rounds: list[int] = field(default_factory=list)  # which generator ran each round

    @property
    def instances(self) -> int:
        return len(self.gens)

    def _prompt(self, r: int, i: int) -> np.ndarray:
        return self.prompts[(r * self.calls + i) % len(self.prompts)]

    def settle(self, k: int, r: int) -> None:
        first = self._prompt(r, 0)
        short = first[:, : min(SETTLE_PROMPT, first.shape[1])] if first.ndim == 2 else first  # a spectrogram: fixed
        self.gens[k].generate(short, min(2, self.new), keep_logits=False)

    def timed_round(self, k: int, r: int) -> None:
        self.instance_rounds.append(k)
        self.rounds.append([self.gens[k].generate(self._prompt(r, i), self.new, keep_logits=False)
                            for i in range(self.calls)])

    def e2e_ms(self) -> list[float]:
        return [g.e2e_ms for rnd in self.rounds for g in rnd]


def judged_rounds(parent: list[list[Generation]], child: list[list[Generation]]
                  ) -> tuple[harness.RoundsPair, harness.RoundsPair | None]:
    """The two figures a generation stage is judged on against its parent, per round: the task time of each
    generation, and each generation's median time per token (None when a round has no step to time)."""
    task = ([[g.e2e_ms for g in rnd] for rnd in parent], [[g.e2e_ms for g in rnd] for rnd in child])
    tp = [[float(np.median(g.tpot_ms)) for g in rnd if g.tpot_ms] for rnd in parent]
    tc = [[float(np.median(g.tpot_ms)) for g in rnd if g.tpot_ms] for rnd in child]
    return task, ((tp, tc) if all(tp) and all(tc) else None)


def timed_generation_rounds(
    sides: list[tuple[str, list[Any]]],
    prompts: list[np.ndarray],
    new: int,
    settings: Any,
    on_round: Callable[[int], None] | None = None,
) -> tuple[dict[str, list[list[Generation]]], dict[str, list[int]], int]:
    """Interleaved rounds of whole generations through the one timing loop (harness.interleave), in the order
    given (first side first in round 0), `settings.iterations` generations a round, the side named "parent" on
    the parent's schedule. Each switch settles as forward timing does (`settle_ms` asleep, then
    GenerationSide.settle): without it the side timed second paid for the first one's spinning pool threads.
    Rounds stop as forward stages' do (harness.until_resolved on the child's task times, and on the task time's
    and TPOT's ratios to the parent). Returns (generations per side per round, generator used per round, rounds).
    """
    timed = {name: GenerationSide(gens, prompts, new, settings.iterations) for name, gens in sides}
    parent, child = timed.get("parent"), timed["child"]

    def ratios() -> list[harness.RoundsPair]:
        return [] if parent is None else [x for x in judged_rounds(parent.rounds, child.rounds) if x is not None]

    r = harness.interleave(list(timed.values()), settings.settle_ms,
                           harness.until_resolved(settings, child.e2e_ms, ratios if parent is not None else None),
                           parent=parent, on_round=on_round)
    return {n: t.rounds for n, t in timed.items()}, {n: t.instance_rounds for n, t in timed.items()}, r


def _reference_outputs(gen: Any, feeds: FeedSet) -> Reference:
    """Every sample's greedy generation (tokens and logits per step), as the reference holds it."""
    return {sf.scenario.name: [_as_reference(gen.generate(prompt_of(f), sf.scenario.new_tokens))
                               for f in sf.samples] for sf in feeds}


def _accuracy(outputs: Reference, ref: Reference) -> dict[str, dict[str, float]]:
    """The worst token agreement and logits cosines over every sample, against stage 0's generations."""
    worst: dict[str, float] = {"token_agreement": 1.0, "cosine": 1.0, "logits_cosine_min": 1.0}
    for scen, samples in outputs.items():
        for expected, got in zip(ref[scen], samples, strict=True):
            a = agreement(_from_reference(expected), _from_reference(got))
            worst["token_agreement"] = min(worst["token_agreement"], a["token_agreement"])
            worst["cosine"] = min(worst["cosine"], a["logits_cosine_before_divergence"])
            worst["logits_cosine_min"] = min(worst["logits_cosine_min"], a["logits_cosine_min"])
    return {"generation": worst}


def _load_generators(
    gen: Any, artifact: Artifact, parent: Artifact | None, recipe: Recipe
) -> tuple[list[Any], list[Any], str | None]:
    """The stage's generators and its parent's (none without a parent): `benchmark.instances` a side, taken in
    turn by round (measure.harness), or one a side and why when the twins cannot load."""
    if parent is None:
        return [gen], [], None
    parent_gen = generator_for(parent, recipe)
    copies = instances_for(recipe.benchmark) - 1
    if copies < 1:
        return [gen], [parent_gen], None
    try:
        return ([gen] + [generator_for(artifact, recipe) for _ in range(copies)],
                [parent_gen] + [generator_for(parent, recipe) for _ in range(copies)], None)
    except Exception as e:  # out of memory, of any library: timed with one generator a side
        return [gen], [parent_gen], twins_refused(copies, e)


def _scenario_metrics(runs: dict[str, list[list[Generation]]], used: dict[str, list[int]], rounds: int,
                      prompt: np.ndarray, new: int, batch: int, confidence: float) -> ScenarioMetrics:
    """A scenario's figures from its timed generations: TTFT, TPOT, task time and tokens/s; against the parent
    (when timed with one) the task time's and the TPOT's interleaved ratios with the spread between instances."""
    child = [g for rnd in runs["child"] for g in rnd]
    e2e = latency_of([g.e2e_ms for g in child])
    entry = ScenarioMetrics(
        latency=e2e,
        ttft=latency_of([g.ttft_ms for g in child]),
        tpot=latency_of([t for g in child for t in g.tpot_ms] or [0.0]),
        throughput=Throughput(tokens_per_s=batch * new * 1000 / e2e.mean_ms, samples_per_s=batch * 1000 / e2e.mean_ms),
        iterations=len(child),
        rounds=rounds,
        prompt_tokens=int(prompt.shape[-1]),  # an encoder-decoder's source: tokens, or a spectrogram's frames
        new_tokens=new,
        samples_ms=[round(g.e2e_ms, 4) for g in child],
    )
    if "parent" not in runs:
        return entry
    (p_rounds, c_rounds), per_token = judged_rounds(runs["parent"], runs["child"])
    entry.parent_latency = latency_of([x for rnd in p_rounds for x in rnd])
    parent_runs = [g for rnd in runs["parent"] for g in rnd]  # for the explanation per prefill and step
    entry.parent_ttft = latency_of([g.ttft_ms for g in parent_runs])
    entry.parent_tpot = latency_of([t for g in parent_runs for t in g.tpot_ms] or [0.0])
    entry.vs_parent = speedup(p_rounds, c_rounds, confidence)
    spread = instance_variance(p_rounds, c_rounds, used["parent"], used["child"])
    if spread is not None:  # widened by the run's pooled spread (measure.instances)
        entry.instance_variance, entry.instance_df = spread.variance, spread.df
        entry.instance_factor = spread.factor
    if per_token is not None:  # TPOT's own interleaved ratio and interval
        tp, tc = per_token
        entry.tpot_vs_parent = speedup(tp, tc, confidence)
        spread = instance_variance(tp, tc, used["parent"], used["child"])
        if spread is not None:
            entry.tpot_instance_variance, entry.tpot_instance_df = spread.variance, spread.df
    return entry


def _time_scenarios(
    child_gens: list[Any], parent_gens: list[Any], recipe: Recipe, feeds: FeedSet, progress: Progress, label: str
) -> tuple[dict[str, ScenarioMetrics], MachineLoad | None]:
    """Every scenario warmed up and timed interleaved (timed_generation_rounds) in the host's bench slot, with
    the other processes' load meanwhile; on CUDA also the kernels one whole task runs."""
    from optimizer.measure.machine import LoadSampler

    settings = recipe.benchmark
    scenarios: dict[str, ScenarioMetrics] = {}
    total, done = len(recipe.scenarios) * settings.rounds, 0
    with bench_slot(f"{label} timing"), LoadSampler() as load:  # warm-up and the interleaved rounds
        for sf in feeds:
            prompt, new = prompt_of(sf.timing), sf.scenario.new_tokens
            prompts = [prompt_of(f) for f in sf.samples]  # timed in turn, parent and child on the same prompt
            sides = [("child", child_gens)] + ([("parent", parent_gens)] if parent_gens else [])
            for _, gens in sides:  # at least once: a CUDA-graph stage captures its decode step on its first run
                for g in gens:
                    for _ in range(max(1, min(settings.warmup, 2))):
                        g.generate(prompt, new, keep_logits=False)

            def on_round(_: int, name: str = sf.scenario.name) -> None:
                nonlocal done
                done += 1
                progress(f"generating {name}", done, total)

            runs, used, r = timed_generation_rounds(sides, prompts, new, settings, on_round)
            entry = _scenario_metrics(runs, used, r, prompt, new, sf.scenario.batch, settings.confidence)
            if recipe.target.device == "cuda":  # per whole task (prefill + new_tokens - 1 decode steps)
                from optimizer.runtime.gpu.kernels import profile_kernels

                counts = profile_kernels(lambda g=child_gens[0], p=prompt, n=new: g.generate(p, n, False), calls=1)
                entry.cuda_kernels = CudaKernels.model_validate(counts)
            scenarios[sf.scenario.name] = entry
    return scenarios, MachineLoad.model_validate(load.result) if load.result else None


# A whole generation longer than this (a real-size decoder: 3 s at 0.5B on 2 cores) is profiled once after the
# warm-up instead of three times: its op medians are over every decode step of that one generation already, and
# the three cost a 0.5B compile about 20 s a stage.
LONG_GENERATION_MS = 2000.0


def profile_reps(task_ms: float) -> int:
    """Generations the op profile of a scenario takes (see LONG_GENERATION_MS)."""
    return 1 if task_ms > LONG_GENERATION_MS else 3


def _profile(artifact: Artifact, recipe: Recipe, gen: Any, feeds: FeedSet, scenarios: dict[str, ScenarioMetrics],
             progress: Progress, label: str) -> Any:
    """Every scenario's prefill and decode step profiled (a long prompt changes where the time goes), onto its
    ScenarioMetrics; returns the first scenario's profile (the stage-level fields)."""
    progress("profiling the prefill and the decode step", 0, 0)
    with bench_slot(f"{label} profile"):  # profiled calls are timings too
        by_scenario = {
            sf.scenario.name: generation_profile(artifact, recipe, gen, prompt_of(sf.timing), sf.scenario.new_tokens,
                                                 profile_reps(scenarios[sf.scenario.name].latency.p50_ms))
            for sf in feeds
        }
    for name, p in by_scenario.items():
        scenarios[name].profile = scenario_profile(p.decode, p.source or None, p.prefill)
    return by_scenario[next(iter(feeds)).scenario.name]


def measure_generation_stage(
    artifact: Artifact,
    parent: Artifact | None,
    recipe: Recipe,
    feeds: FeedSet,
    reference: Reference | None,
    progress: Progress,
    label: str = "stage",
) -> tuple[dict[str, Any], Reference | None]:
    """measure_stage for a decoder: load, accuracy against stage 0's generations (reference=None: this is stage
    0 and its generations become the reference), time, profile, memory. The host's bench slot is held only while
    something is timed ("<label> timing", "<label> profile"): the accuracy generations, loading and the memory
    probe may overlap other compiles' build work. Returns (StageMetrics' JSON, the new reference or None)."""
    gc.collect()
    clock = PhaseClock()
    before = _rss()
    gpu_probe = GpuMemoryProbe(recipe.target.device).start()
    gen = generator_for(artifact, recipe)
    clock.lap("load")
    outputs = _reference_outputs(gen, feeds)
    memory_mb = (_rss() - before) / 2**20
    gpu_memory_mb, gpu_memory_method = gpu_probe.result()
    accuracy = _accuracy(outputs, reference if reference is not None else outputs)
    clock.lap("accuracy")
    from optimizer.measure.accuracy import recipe_verdict

    within, why, _ = recipe_verdict(accuracy, recipe)  # no interval: token agreement is judged as measured
    child_gens, parent_gens, twin_note = _load_generators(gen, artifact, parent, recipe)
    clock.lap("load")
    scenarios, load = _time_scenarios(child_gens, parent_gens, recipe, feeds, progress, label)
    del child_gens, parent_gens  # the parent's sessions and the twins go as soon as the rounds end
    gc.collect()
    clock.lap("time")
    runtime = {
        "runtime": "pytorch" if artifact.kind == "torch" else "onnxruntime",
        "device": recipe.target.device,
        "loop": "greedy, KV cache, fixed new_tokens, each token copied to the host as produced",
        "kv_cache": "dynamic",
        **artifact.runtime,
        **(gen.describe() if hasattr(gen, "describe") else {}),
    }
    prof = _profile(artifact, recipe, gen, feeds, scenarios, progress, label)
    del gen  # the fresh-process memory probe loads the stage again: not beside this copy
    gc.collect()
    clock.lap("profile")
    progress("measuring memory", 0, 0)
    memory_mb, memory = stage_memory(artifact, recipe, memory_mb)
    clock.lap("memory")
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
        machine_load=load,
        # first scenario's prompt and new_tokens, from the runtime's own profiler (measure.profiles)
        op_time_ms=prof.decode.ops,  # per decode step
        prefill_op_time_ms=prof.prefill.ops,  # one prefill call
        op_time_source=prof.source or None,
        kernel_time_ms=prof.decode.kernels,  # CUDA: device ms per kernel name (CUPTI)
        prefill_kernel_time_ms=prof.prefill.kernels,
        nodes_executed=prof.decode.nodes,  # ONNX Runtime: node kernels per decode step
        phase_seconds=clock.seconds,
        **({"instance_note": twin_note} if twin_note else {}),
    )
    return metrics.to_json(), outputs if reference is None else None  # StageMetrics' JSON, as measure_stage's
