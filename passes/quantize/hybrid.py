"""Hybrid precision: INT8 where it is harmless, high precision where it is not, under an accuracy budget.

Accuracy: sensitivity of node n = 1 - cosine(output of the input graph, output with only n quantized to INT8) on
the calibration inputs (never on the inputs the stage is judged on), through the one accuracy implementation
(ctx.check): positions the attention mask drops are not compared, so no node is kept in FP32 to
protect padding. Nodes are quantized least sensitive first; bisection finds the largest k whose quantized model
keeps the judged cosine at or above the budget plus a margin (each step a real quantized model).

Speed: more INT8 is not always faster (each quantized op adds quantize/dequantize work), so a ladder of sets up
to that k is timed with the harness (ctx.time), each interleaved with the FP32 input graph, giving
a speedup with its 95% interval. The chosen set is the smallest one whose speed is within `speed_tolerance` of
the fastest at 95% confidence: INT8 nodes stop being added when what they buy is within noise. Every point
(k, cosines, speedup and its interval, P50s) is saved in hybrid_search.json. With `choose: most_int8` the
timing is skipped and the largest set within budget is kept. When no set meets the budget, the stage keeps every
node in the input's precision and says so. The high-precision side is FP32 on the CPU, where FP16 is slower.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.core.metrics import TimedComparison
from optimizer.core.pass_base import PassContext
from passes.quantize.modes import int8_dynamic


@dataclass
class Search:
    budget: float
    margin: float
    choose: str = "fastest"
    speed_tolerance: float = 0.03
    sensitivity: dict[str, float] = field(default_factory=dict)
    points: list[dict[str, Any]] = field(default_factory=list)
    timings: list[dict[str, Any]] = field(default_factory=list)
    decision: str = ""


class Evaluator:
    """Runs candidate models on the search inputs and compares the judged output with the input graph's (kept
    positions only) through ctx.check; times candidates against the input graph through ctx.time."""

    def __init__(
        self,
        src: Path,
        feeds: list[dict[str, np.ndarray]],
        timing_feeds: list[dict[str, np.ndarray]],
        ctx: PassContext,
        runtime: dict[str, Any],
        metric: str = "cosine",
    ) -> None:
        self.src, self.feeds, self.timing_feeds = src, feeds, timing_feeds
        self.ctx, self.runtime, self.metric = ctx, runtime, metric
        with ctx.session(self._artifact(src)) as session:
            names = session.output_names
            output = ctx.recipe.accuracy.output
            self.index = names.index(output) if output in names else 0
            self.reference = [session.to_numpy(session.run(session.prepare(f))) for f in feeds]

    def _artifact(self, path: Path) -> Artifact:
        return Artifact("onnx", path, dict(self.runtime))

    def __getstate__(self) -> dict[str, Any]:  # sent to ctx.map's workers without the context: see on()
        return {k: v for k, v in self.__dict__.items() if k != "ctx"}

    def on(self, ctx: PassContext) -> Evaluator:
        """This evaluator through another context (a ctx.map worker's)."""
        copy = Evaluator.__new__(Evaluator)
        copy.__dict__.update(self.__getstate__(), ctx=ctx)
        return copy

    def accuracy(self, path: Path, device: str = "cpu") -> dict[str, float]:
        """The judged output's worst per-sample cosine (or pooled cosine) over the search inputs, and the mean of
        each input's mean; an input with NaN/inf where the input graph is finite scores 0. `device`: where the
        graph runs (the GPU hybrid checks its deployable graph on cuda too)."""
        worst, means = 1.0, []
        with self.ctx.session(self._artifact(path), device=device) as session:

            def judged(feed: dict[str, np.ndarray]) -> list[np.ndarray]:
                return [session.to_numpy(session.run(session.prepare(feed)))[self.index]]

            for ref, feed in zip(self.reference, self.feeds, strict=True):
                check = self.ctx.check([[ref[self.index]]], judged, [feed])
                value = check.worst(self.metric)
                acc = next(iter(check.per_output.values()))
                mean = acc.figure(f"{self.metric}_mean")
                means.append((mean if mean is not None else value) if value > 0 else 0.0)
                worst = min(worst, value)
        return {"cosine": worst, "cosine_mean": float(np.mean(means)) if means else 1.0}

    def cosine(self, path: Path) -> float:
        return self.accuracy(path)["cosine"]

    def speed(self, path: Path) -> TimedComparison:
        """The candidate timed interleaved with the input graph (the harness, through ctx.time): its ratio over
        the input (> 1: faster) with the 95% interval, and both P50s."""
        return self.ctx.time(self._artifact(path), self._artifact(self.src), self.timing_feeds)


def _log_sigma(t: dict[str, Any]) -> float:
    return (math.log(t["high"]) - math.log(t["low"])) / (2 * 1.96)


def relative_low(candidate: dict[str, Any], best: dict[str, Any]) -> float:
    """Lower end of the 95% interval of candidate speed / best speed, from their two measurements against the
    same input graph (independent sessions: variances add in log space)."""
    mu = math.log(candidate["ratio"]) - math.log(best["ratio"])
    sigma = math.sqrt(_log_sigma(candidate) ** 2 + _log_sigma(best) ** 2)
    return math.exp(mu - 1.96 * sigma)


def ladder(lo: int) -> list[int]:
    """The INT8 set sizes timed: quarters of the largest set within budget, ascending."""
    return sorted({max(1, round(lo * f)) for f in (0.25, 0.5, 0.75)} | {lo})


def search(
    src: Path,
    work: Path,
    nodes: list[str],
    evaluator: Evaluator,
    state: Search,
    per_channel: bool,
    ops: list[str],
    progress: Any,
    timed: bool = True,
) -> list[str]:
    """The INT8 node set chosen (possibly empty); fills state."""
    total = len(nodes)
    single = partial(int8_sensitivity, evaluator, src, work, per_channel, ops)
    state.sensitivity.update(zip(nodes, evaluator.ctx.map(single, list(enumerate(nodes)), "sensitivity per node"),
                                 strict=True))
    order = sorted(nodes, key=lambda n: state.sensitivity[n])
    target = state.budget + state.margin
    tried: dict[int, dict[str, float]] = {}

    def build(k: int) -> Path:
        path = work / f"k{k}.onnx"
        if not path.exists():
            int8_dynamic(src, path, per_channel, ops, order[:k], [])
        return path

    def point(k: int) -> float:
        if k not in tried:
            tried[k] = evaluator.accuracy(build(k))
            state.points.append({"int8_nodes": k, **tried[k]})
            progress("searching INT8 sets", len(tried), len(tried) + 3)
        return tried[k]["cosine"]

    lo, hi = 0, total  # invariant: lo meets the target (0 = nothing quantized), hi unknown
    if point(total) >= target:
        lo = total
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if point(mid) >= target:
                lo = mid
            else:
                hi = mid
    if lo == 0:
        state.decision = f"no INT8 set met {evaluator.metric} >= {state.budget} + margin {state.margin}"
        return []
    chosen = lo
    if state.choose == "fastest" and timed:
        chosen = _choose_by_speed(lo, build, point, evaluator, state, progress)
    else:
        state.decision = f"the largest set within budget ({lo} nodes; choose: {state.choose})"
    shutil.copyfile(build(chosen), work / "chosen.onnx")
    return order[:chosen]


@contextmanager
def _one_quantizer_at_a_time(work: Path) -> Iterator[None]:
    """ORT's quantizer writes `<src>-inferred.onnx` beside its input and deletes it: two processes of ctx.map
    quantizing the same input would delete each other's file. The quantizations take turns (the evaluations,
    most of the time, still run in parallel)."""
    import fcntl

    fd = os.open(work / ".quantizer.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def int8_sensitivity(evaluator: Evaluator, src: Path, work: Path, per_channel: bool, ops: list[str],
                     ctx: PassContext, item: tuple[int, str]) -> float:
    """1 - cosine with node `item` alone in INT8: a pure function of the graph, the search inputs and the node,
    so ctx.map may run it in another process."""
    i, node = item
    path = work / f"single{i}.onnx"
    with _one_quantizer_at_a_time(work):
        int8_dynamic(src, path, per_channel, ops, [node], [])
    try:
        return 1.0 - evaluator.on(ctx).cosine(path)
    finally:
        path.unlink(missing_ok=True)


def _choose_by_speed(lo: int, build: Any, point: Any, evaluator: Evaluator, state: Search, progress: Any) -> int:
    sizes = ladder(lo)
    timed: dict[int, dict[str, Any]] = {}
    for i, k in enumerate(sizes):
        point(k)  # every timed set is also within the budget (smaller sets than lo are, by sensitivity order)
        timed[k] = {"int8_nodes": k, **evaluator.speed(build(k)).to_json()}
        state.timings.append(timed[k])
        progress("timing INT8 sets against FP32", i + 1, len(sizes))
    fastest = max(timed.values(), key=lambda t: t["ratio"])
    for k in sizes:  # ascending: the fewest INT8 nodes whose speed is that of the fastest set, within noise
        t = timed[k]
        t["vs_fastest_low"] = 1.0 if t is fastest else relative_low(t, fastest)
        if t is fastest or t["vs_fastest_low"] >= 1 - state.speed_tolerance:
            state.decision = (
                f"{k} INT8 nodes: {t['ratio']:.2f}x the FP32 input ({t['low']:.2f}-{t['high']:.2f}); the fastest "
                f"set timed ({fastest['int8_nodes']} nodes, {fastest['ratio']:.2f}x) is at most "
                f"{state.speed_tolerance:.0%} faster at 95% confidence"
                if t is not fastest
                else f"{k} INT8 nodes: the fastest set timed, {t['ratio']:.2f}x the FP32 input "
                f"({t['low']:.2f}-{t['high']:.2f}); fewer INT8 nodes were slower beyond "
                f"{state.speed_tolerance:.0%}"
            )
            return k
    return int(fastest["int8_nodes"])  # pragma: no cover - the fastest always qualifies
