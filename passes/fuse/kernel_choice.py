"""Kernel choice: a fused op earns its place only if its kernel is faster on the target than the ops it replaces.

Fusing is not always faster. On these AVX-512 cores, onnxruntime 1.32's CPU SkipLayerNormalization is slower than
the Add + LayerNormalization it replaces: on MiniLM at b1-s128 its 12 kernels took 1.69 ms per call against 0.92 ms
for the ops they replace (the main job's fuse stage, below). So the rules named in
`fuse`'s `measure` are measured two ways on the recipe's first scenario. The kernels: ONNX Runtime's per-node
profile of both graphs, summed over the op types whose node counts differ between them (the fused op on one
side, the ops it replaces on the other), medians of ten calls: a precise reading of exactly what the rule
changes. The whole graph: the graph without the rule against the graph with it, interleaved by the harness
(ctx.time: benchmark settings, sessions a side). A rule is left out when its kernels cost at least `MIN_KERNEL_GAIN`
more than the ops they replace and the whole graph without it is not measured slower (the interval below 1: a
point estimate under 1 within noise is noise, and the profile is the precise reading);
without a profile (another runtime), when the whole graph without it is at least `MIN_GAIN` faster. Both graphs
compute the same thing, so the choice needs no proof of a speedup beyond the measurement, as a builder's tactic
timing picks the fastest kernel; the margins make a tie keep the fused graph. When a rule is left out, ONNX
Runtime's own load-time fusion of the same pattern (the rule's `ort_fusions`) is disabled in the artifact's
runtime, which later stages and bundles inherit, or ORT would make the fusion again when it loads the graph.

Measured on MiniLM's FP32 fuse stage at b1-s128 (optimizer compile recipes/minilm-cpu.yaml): kernels 1.69 ms
with the rule against 0.92 ms without; the whole graph without it 1.03x (1.01-1.07), and 1.06x (0.97-1.16) in
another run (ten rounds cannot always exclude a tie where under 1 ms of 17 is at stake, which is why the profile
decides); the INT8 graphs built on it ran 2.72-2.82x the FP32 session instead of 2.34x (benchmarks/bench_quantize.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError
from optimizer.core.metrics import TimedComparison
from optimizer.core.pass_base import PassContext, PassNotes
from passes.fuse.rule import RULES_BY_NAME

MIN_KERNEL_GAIN = 0.10  # the fused kernels must cost 10% more than the ops they replace (profile) to leave them out
MIN_GAIN = 0.02  # without a profile: the graph without a rule at least 2% faster (point estimate)
PROFILED_CALLS = 10


@dataclass
class KernelCost:
    """ORT's profile of both graphs over the op types whose node counts differ between them: ms per call."""

    op_types: list[str]
    with_rule_ms: float
    without_rule_ms: float

    def cheaper_without(self) -> bool:
        return self.without_rule_ms <= self.with_rule_ms * (1 - MIN_KERNEL_GAIN)


def kernel_cost(with_rule: Artifact, without_rule: Artifact, ctx: PassContext) -> KernelCost | None:
    """The kernels the rule changes, profiled in both graphs on the first scenario's timing input; None when the
    artifacts are not ONNX Runtime graphs or the profile fails (the whole-graph timing decides then)."""
    from optimizer.runtime import onnx_io
    from optimizer.runtime.runners.ort_runner import op_time_breakdown

    if with_rule.kind != "onnx" or without_rule.kind != "onnx" or with_rule.path is None or without_rule.path is None:
        return None
    before, after = onnx_io.op_histogram(with_rule.path), onnx_io.op_histogram(without_rule.path)
    # The histogram qualifies contrib ops by domain; ORT's profile names op types without it.
    changed = sorted({k.split(".")[-1] for k in set(before) | set(after) if before.get(k, 0) != after.get(k, 0)})
    if not changed:
        return None
    feed = next(iter(ctx.feeds)).timing
    try:
        ops_with, _ = op_time_breakdown(with_rule, ctx.recipe, feed, PROFILED_CALLS)
        ops_without, _ = op_time_breakdown(without_rule, ctx.recipe, feed, PROFILED_CALLS)
    except Exception:  # a profile is an aid to the choice, not a condition of the stage
        return None
    return KernelCost(
        changed, sum(ops_with.get(t, 0.0) for t in changed), sum(ops_without.get(t, 0.0) for t in changed)
    )


class KernelChoiceNote(PassNotes):
    """One measured rule in the fuse stage's notes (`kernel_choice`): whether it was kept and the line that says
    why; with a timing, the graph without the rule against the graph with it (ctx.time) and the kernels' costs."""

    fused: int | None = None  # places the rule fused in the graph it was measured in
    kept: bool = True
    without_rule_speedup: float | None = None  # graph with the rule P50 / without it: > 1, faster without
    low: float | None = None
    high: float | None = None
    verdict: str | None = None
    p50_ms_with: float | None = None
    p50_ms_without: float | None = None
    ort_fusions_disabled: list[str] | None = None
    kernel_op_types: list[str] | None = None
    kernel_ms_with: float | None = None
    kernel_ms_without: float | None = None
    line: str


@dataclass
class KernelChoice:
    rule: str
    fused: int  # places the rule fused in the graph it was measured in
    kept: bool
    timing: TimedComparison | None  # ctx.time of the graph without the rule (candidate) against the graph with it
    disabled: list[str]  # ONNX Runtime fusions disabled because the rule was left out
    kernels: KernelCost | None = None
    failed: str | None = None  # why it could not be measured (the rule is kept)

    def note(self) -> KernelChoiceNote:
        t = self.timing
        if t is None:
            return KernelChoiceNote(fused=self.fused, kept=True, line=self.line())
        return KernelChoiceNote.model_validate({
            "fused": self.fused,
            "kept": self.kept,
            "without_rule_speedup": t.ratio,
            "low": t.low,
            "high": t.high,
            "verdict": t.verdict,
            "p50_ms_with": t.input_p50_ms,
            "p50_ms_without": t.p50_ms,
            "ort_fusions_disabled": self.disabled,
            **({"kernel_op_types": self.kernels.op_types, "kernel_ms_with": self.kernels.with_rule_ms,
                "kernel_ms_without": self.kernels.without_rule_ms} if self.kernels is not None else {}),
            "line": self.line(),
        })

    def line(self) -> str:
        t, k = self.timing, self.kernels
        if t is None:
            return f"{self.rule}: kept; {self.failed}"
        ratio = f"{t.ratio:.2f}x ({t.low:.2f}-{t.high:.2f}, {t.verdict})"
        cost = (
            f"its kernels {k.with_rule_ms:.2f} ms per call against {k.without_rule_ms:.2f} ms for the ops they "
            f"replace ({', '.join(k.op_types)}: ORT profile); "
            if k is not None
            else ""
        )
        head = f"{self.rule}: {'kept' if self.kept else 'left out'}; {cost}"
        ort = f"; onnxruntime's {', '.join(self.disabled)} disabled" if self.disabled else ""
        return f"{head}the graph without its {self.fused} fusions ran {ratio}{ort}"


def disabled_runtime(runtime: dict[str, Any], rule: str) -> tuple[dict[str, Any], list[str]]:
    """The runtime with ORT's fusions of `rule` disabled too, and the names added."""
    have = list(runtime.get("disabled_optimizers") or [])
    new = [f for f in RULES_BY_NAME[rule].ort_fusions if f not in have]
    return ({**runtime, "disabled_optimizers": have + new} if new else dict(runtime)), new


def choose_kernels(
    rules: list[str],
    measure: list[str],
    fused: dict[str, int],
    built: Artifact,
    build: Callable[[list[str], str], Artifact],
    ctx: PassContext,
) -> tuple[Artifact, list[KernelChoice]]:
    """The artifact the kept rules make, and one choice per measured rule that fused something, in
    `measure`'s order, each judged against the graph the choices before it left (greedy: one measurement a rule;
    the rule of choice is in the module's docstring).
    build(rules, label) writes the graph those rules make and returns it as an artifact (runtime: `built`'s)."""
    current, keep, choices = built, list(rules), []
    todo = [r for r in measure if r in keep and fused.get(r, 0) > 0]
    for i, rule in enumerate(todo):
        ctx.progress(f"kernel choice: timing the graph without {rule}", i, len(todo))
        without = [r for r in keep if r != rule]
        runtime, disabled = disabled_runtime(current.runtime, rule)
        try:
            candidate = build(without, f"without_{rule}").derive(runtime=runtime)
            timing = ctx.time(candidate, current)
        except OptimizerError as e:  # the measurement is an aid: a graph that cannot be timed keeps the rule
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            choices.append(KernelChoice(rule, fused[rule], True, None, [], None, f"not measured: {first}"))
            continue
        kernels = kernel_cost(current, candidate, ctx)
        if kernels is not None:  # the profile decides; the whole graph must not be slower without the rule
            kept = not kernels.cheaper_without() or timing.verdict == "slower"
        else:
            kept = timing.ratio < 1 + MIN_GAIN
        choices.append(KernelChoice(rule, fused[rule], kept, timing, [] if kept else disabled, kernels))
        if not kept:
            current, keep = candidate, without
    ctx.progress("kernel choice", len(todo), len(todo))
    return current, choices
