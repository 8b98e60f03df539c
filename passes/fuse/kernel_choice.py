"""Kernel choice: a fused op earns its place only if its kernel is faster on the target than the ops it replaces.

Fusing is not always faster. On these AVX-512 cores, onnxruntime 1.32's CPU SkipLayerNormalization took ~130 us a
call on MiniLM's 1x128x384 activations, where a LayerNormalization of the same shape took ~25 us and the Add
~15 us (ORT's per-node profile of the INT8 graph): fused, the INT8 MiniLM ran 1.13x slower. So the rules named in
`fuse`'s `measure` are timed: the graph without the rule against the graph with it, interleaved by the harness
(ctx.time: the recipe's first scenario, its benchmark settings and sessions a side), and the faster graph wins, as
a builder's tactic timing picks the fastest kernel: both graphs compute the same thing, so the choice needs no
proof beyond the measurement, only a margin (`MIN_GAIN`) so that a tie keeps the fused graph. The interval is
reported beside it. When a rule is left out, ONNX Runtime's own load-time fusion of the same pattern (the rule's
`ort_fusions`) is disabled in the artifact's runtime, which later stages and bundles inherit, or ORT would make
the fusion again when it loads the graph.

Measured on MiniLM's FP32 fuse stage at b1-s128 (optimizer compile recipes/minilm-cpu.yaml): without
SkipLayerNormalization 1.06x (0.97-1.16; ten rounds cannot exclude a tie where ~1 ms of 17 is at stake); the INT8
graphs built on it then ran 2.82x the FP32 session instead of 2.34x (scripts/bench_quantize.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.pass_base import PassContext
from passes.fuse.rule import RULES_BY_NAME

MIN_GAIN = 0.02  # the graph without a rule must run at least 2% faster (point estimate) to leave the rule out


@dataclass
class KernelChoice:
    rule: str
    fused: int  # places the rule fused in the graph it was measured in
    kept: bool
    timing: dict[str, Any]  # ctx.time of the graph without the rule (candidate) against the graph with it
    disabled: list[str]  # ONNX Runtime fusions disabled because the rule was left out

    def to_json(self) -> dict[str, Any]:
        t = self.timing
        return {
            "fused": self.fused,
            "kept": self.kept,
            "without_rule_speedup": t["speedup"],
            "low": t["low"],
            "high": t["high"],
            "verdict": t["verdict"],
            "p50_ms_with": t["input_p50_ms"],
            "p50_ms_without": t["p50_ms"],
            "ort_fusions_disabled": self.disabled,
            "line": self.line(),
        }

    def line(self) -> str:
        t = self.timing
        ratio = f"{t['speedup']:.2f}x ({t['low']:.2f}-{t['high']:.2f})"
        if self.kept:
            return f"{self.rule}: kept; the graph without its {self.fused} fusions ran {ratio} ({t['verdict']})"
        ort = f"; onnxruntime's {', '.join(self.disabled)} disabled" if self.disabled else ""
        return f"{self.rule}: left out; the graph without its {self.fused} fusions ran {ratio} ({t['verdict']}){ort}"


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
) -> tuple[list[str], Artifact, list[KernelChoice]]:
    """Rules to keep, the artifact they make, and one choice per measured rule that fused something, in
    `measure`'s order, each judged against the graph the choices before it left (greedy: one timing a rule), by
    the point estimate of the ratio (see the module's docstring).
    build(rules, label) writes the graph those rules make and returns it as an artifact (runtime: `built`'s)."""
    current, keep, choices = built, list(rules), []
    todo = [r for r in measure if r in keep and fused.get(r, 0) > 0]
    for i, rule in enumerate(todo):
        ctx.progress(f"kernel choice: timing the graph without {rule}", i, len(todo))
        without = [r for r in keep if r != rule]
        runtime, disabled = disabled_runtime(current.runtime, rule)
        candidate = build(without, f"without_{rule}").derive(runtime=runtime)
        timing = ctx.time(candidate, current)
        kept = timing["speedup"] < 1 + MIN_GAIN
        choices.append(KernelChoice(rule, fused[rule], kept, timing, [] if kept else disabled))
        if not kept:
            current, keep = candidate, without
    ctx.progress("kernel choice", len(todo), len(todo))
    return keep, current, choices
