"""Composite scores and the deployment decision (`optimizer select`), as the seeds weigh them.

Every term is normalized against stage 0, so 1.0 means "as stage 0" and higher is better:
  latency        stage 0 P50 / stage P50 (the chained, interleaved speedup when there is one)
  throughput     stage throughput / stage 0 throughput (tokens/s for generation, samples/s otherwise); for a
                 fixed scenario that is the ratio of mean times, taken (when there is one) from the interleaved
                 sessions and chained like latency, so that drift between stages measured apart does not leak in
  accuracy       the budget's metric against stage 0 (cosine, top-1 or token agreement; 1.0 = identical)
  memory         stage 0 footprint / stage footprint; footprint = peak resident set of serving the stage in a
                 fresh process (optimizer/measure/memprobe.py), at least the model's bytes
  size           stage 0 bytes on disk / stage bytes
  deployability  share of four serving paths that can run the artifact as built: ONNX Runtime CPU, ONNX
                 Runtime CUDA, TensorRT, Triton. Standard ONNX: all four. ORT contrib ops (fused attention,
                 SkipLayerNorm): ORT CPU/CUDA and Triton's ORT backend, 0.75. Dynamic INT8 (CPU kernels): ORT CPU
                 and Triton, 0.5. A TensorRT engine: TensorRT and Triton, tied to one GPU and version, 0.5.
                 PyTorch eager: a Python service only, 0.25. An OpenVINO IR: OpenVINO's own runtime, and of the
                 four, Triton's OpenVINO backend, 0.25.
score = sum(weight * term). Stages outside the accuracy budget are ranked but never recommended.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from optimizer.core.metrics import StageMetrics
from optimizer.core.stage import StageReport
from optimizer.measure.best import best_stage
from optimizer.report.schema import RunReport
from optimizer.report.timings import require_timings

PRESETS: dict[str, dict[str, float]] = {
    # Seed 1: Performance Score = (1/Avg Latency) x 40% + (Throughput/Baseline) x 30% + (Accuracy/Baseline) x 30%
    "seed-latency": {"latency": 0.4, "throughput": 0.3, "accuracy": 0.3},
    # Seed 2: Total Score = 0.4 x Throughput + 0.3 x Memory + 0.2 x Accuracy + 0.1 x Deployability
    "seed-deploy": {"throughput": 0.4, "memory": 0.3, "accuracy": 0.2, "deployability": 0.1},
}
TERMS = ("latency", "throughput", "accuracy", "memory", "size", "deployability")
STANDARD_DOMAINS = ("", "ai.onnx")


def parse_weights(text: str) -> dict[str, float]:
    """A preset name, or `term=weight,term=weight`."""
    if text in PRESETS:
        return dict(PRESETS[text])
    weights: dict[str, float] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in TERMS:
            raise ValueError(f"unknown term {key!r} (terms: {', '.join(TERMS)}; presets: {', '.join(PRESETS)})")
        try:
            weights[key] = float(value)
        except ValueError:
            raise ValueError(f"weight for {key!r} is not a number: {value!r}") from None
        if not math.isfinite(weights[key]):
            raise ValueError(f"weight for {key!r} must be a finite number, not {value!r}")
    return weights


def deployability(stage: StageReport) -> float:
    kind = stage.artifact.kind if stage.artifact is not None else None
    if kind == "torch":
        return 0.25
    if kind == "trt_engine":
        return 0.5
    if kind == "openvino":  # OpenVINO's runtime (and its model server) and, of the four paths, Triton's backend
        return 0.25
    graph = stage.metrics.graph if stage.metrics is not None else None
    ops = graph.op_types if graph is not None else {}
    if any(op in ops for op in ("DynamicQuantizeLinear", "MatMulInteger", "DynamicQuantizeMatMul")):
        return 0.5
    if any("." in op and not op.startswith("ai.onnx.") for op in ops):  # a non-standard domain
        return 0.75
    return 1.0


def _accuracy(stage: StageReport, metric: str) -> float:
    acc = stage.metrics.first_accuracy if stage.metrics is not None else None
    if acc is None:
        return 0.0
    value = acc.figure(metric if metric != "max_abs" else "cosine")
    return value if value is not None else acc.cosine


def _footprint(m: StageMetrics) -> float:
    return max(float(m.memory_mb or 0.0), float(m.size_bytes or 0) / 2**20, 1.0)


def terms(report: RunReport, stage: StageReport, scenario: str) -> dict[str, float] | None:
    source = report.stages[0]
    s, s0 = stage.scenario(scenario), source.scenario(scenario)
    m, m0 = stage.metrics, source.metrics
    if s is None or s0 is None or m is None or m0 is None:
        return None
    metric = report.settings.accuracy_metric or report.settings.accuracy.get("metric") or "cosine"
    generation = s.throughput.tokens_per_s is not None and s.ttft is not None
    tp, tp_0 = (
        (s.throughput.tokens_per_s, s0.throughput.tokens_per_s)
        if generation
        else (s.throughput.samples_per_s, s0.throughput.samples_per_s)
    )
    vs0 = stage.vs_source.get(scenario)
    tp0 = stage.throughput_vs_source.get(scenario)
    return {
        "latency": vs0 if vs0 else s0.latency.p50_ms / s.latency.p50_ms,
        "throughput": tp0 if tp0 else tp / tp_0,  # type: ignore[operator]
        "accuracy": _accuracy(stage, metric),
        "memory": _footprint(m0) / _footprint(m),
        "size": float(m0.size_bytes or 1) / float(m.size_bytes or 1),
        "deployability": deployability(stage),
    }


@dataclass(frozen=True)
class Ranked:
    """One stage in one scenario, scored by the weights: score = sum of weight x term."""

    stage: str
    score: float
    terms: dict[str, float]  # term name (latency, throughput, accuracy, memory, size, deployability) -> value
    within_budget: bool


def rank(report: RunReport, weights: dict[str, float]) -> dict[str, list[Ranked]]:
    """scenario -> stages sorted by score (best first), each with its terms and budget verdict."""
    require_timings(report, "the run")  # the terms divide by them: a zero is one line, not a ZeroDivisionError
    out: dict[str, list[Ranked]] = {}
    for scen in report.scenario_names:
        rows = []
        for st in report.stages:
            if not st.ok:
                continue
            t = terms(report, st, scen)
            if t is None:
                continue
            score = sum(w * t[k] for k, w in weights.items())
            within = st.metrics.within_budget if st.metrics is not None else True
            rows.append(Ranked(st.name, score, t, within))
        out[scen] = sorted(rows, key=lambda r: -r.score)
    return out


def per_scenario_lines(report: RunReport, ranking: dict[str, list[Ranked]]) -> list[str]:
    """Per scenario: the highest score within budget by these weights, and the fastest stage within budget there
    (stage 0 included: `export --stage best --scenario NAME` takes it)."""
    winners = report.best.per_scenario if report.best is not None else {}
    lines = []
    for scen, rows in ranking.items():
        top = next((r for r in rows if r.within_budget), None)
        if top is None:
            continue
        line = f"{scen}: by these weights `{top.stage}` scores highest within budget ({top.score:.3f})"
        w = winners.get(scen)
        if w is not None:
            who = f"stage 0, `{w.stage}` (keep it)" if w.keep_source else f"`{w.stage}`"
            line += f"; fastest within budget: {who}, {w.ratio:.2f}x stage 0 ({w.low:.2f}-{w.high:.2f})"
        lines.append(line + ".")
    return lines


def recommend(report: RunReport, weights: dict[str, float]) -> tuple[str | None, list[str]]:
    """The stage to deploy (best mean score over scenarios among stages within budget) and why, in a few lines."""
    ranking = rank(report, weights)
    totals: dict[str, list[float]] = {}
    for rows in ranking.values():
        for r in rows:
            if r.within_budget:
                totals.setdefault(r.stage, []).append(r.score)
    n = len(ranking)
    eligible = {k: sum(v) / len(v) for k, v in totals.items() if len(v) == n}
    if not eligible:
        return None, ["no stage was measured in every scenario within the accuracy budget"]
    best = max(eligible, key=lambda k: eligible[k])
    wins = sum(1 for rows in ranking.values() if next((r.stage for r in rows if r.within_budget), None) == best)
    ordered = sorted(eligible.items(), key=lambda kv: -kv[1])
    lines = [
        f"Deploy `{best}`: mean score {eligible[best]:.3f} over {n} scenario(s), best within budget in {wins} of {n}."
    ]
    if len(ordered) > 1:
        lines.append(f"Next: `{ordered[1][0]}` at {ordered[1][1]:.3f}.")
    fastest, why = best_stage(report.stages, report.scenario_names)
    if fastest is not None:
        lines.append(f"Fastest within budget (what `export --stage best` and the batch sweep take): {why}.")
    lines += per_scenario_lines(report, ranking)
    for scen, rows in ranking.items():
        r = next(r for r in rows if r.stage == best)
        t = r.terms
        lines.append(
            f"{scen}: {t['latency']:.2f}x the speed of stage 0, throughput {t['throughput']:.2f}x, "
            f"accuracy {t['accuracy']:.4f}, footprint {1 / t['memory']:.2f}x, deployability {t['deployability']}."
        )
        top = rows[0]
        if not top.within_budget:
            lines.append(
                f"{scen}: `{top.stage}` scores higher ({top.score:.3f}) but is outside the accuracy "
                "budget, so it is not recommended."
            )
    return best, lines
