"""The CPU engines side by side: ONNX Runtime FP32 on the export, our best ONNX Runtime stage, every OpenVINO stage
of a run (and the run's overall best), timed interleaved in one process on every sample of each scenario.

Each variant runs `--instances` sessions taken in turn by pairs of rounds (the intervals are widened by their
spread, as the harness does); every ratio is against "ort fp32": the run's export stage under ONNX Runtime with
all its graph optimizations (the plain FP32 deployment a user has before any of our passes). Accuracy is the
run's own (report.json): the budget's metric against stage 0 on held-out sentences.

    python scripts/compare_engines.py runs/minilm-cpu [--scenario b1-s128 --scenario b1-s512] [--rounds 16]
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.measure.best import best_stage
from optimizer.measure.harness import interleaved_twin_rounds
from optimizer.measure.stats import speedup_with_spread
from optimizer.recipe.loading import parse_recipe
from optimizer.report.schema import read_report
from optimizer.runtime.inputs import build_feeds
from optimizer.runtime.runners import runner_for

BASE = "ort fp32 (export, ORT all)"


def variants(report: Any) -> dict[str, tuple[Artifact, Any]]:
    """Label -> (artifact, stage report or None): the baseline, the best ONNX stage, every OpenVINO stage, best."""
    by_name = {s.name: s for s in report.stages}
    export = by_name.get("export")
    if export is None or export.artifact is None:
        raise SystemExit(f"{report.run_dir}: no export stage to compare with")
    out: dict[str, tuple[Artifact, Any]] = {
        BASE: (export.artifact.derive(runtime={"graph_optimization_level": "all"}), None)}
    onnx = [s for s in report.stages if s.index == 0 or (s.artifact is not None and s.artifact.kind == "onnx")]
    best_ort, _ = best_stage(onnx, report.scenario_names)
    if best_ort is not None and best_ort.artifact is not None:
        out[f"best ORT: {best_ort.name}"] = (best_ort.artifact, best_ort)
    for st in report.stages:
        if st.ok and st.artifact is not None and st.artifact.kind == "openvino":
            out[f"openvino: {st.name}"] = (st.artifact, st)
    best = by_name.get(report.best.stage) if report.best is not None and report.best.stage else None
    if best is not None and best.artifact is not None and all(st is not best for _, st in out.values()):
        out[f"run best: {best.name}"] = (best.artifact, best)
    return out


def _accuracy(stage: Any, metric: str) -> str:
    if stage is None or stage.metrics is None or not stage.metrics.accuracy:
        return "1.0000 (the export, FP32)"
    acc = next(iter(stage.metrics.accuracy.values()))
    value = acc.figure(metric) if hasattr(acc, "figure") else None
    budget = "ok" if stage.metrics.within_budget else "REJECTED"
    return f"{value if value is not None else acc.cosine:.4f} ({budget})"


def bench(recipe: Any, report: Any, scenario: str, rounds: int, iterations: int, instances: int) -> list[str]:
    feeds = build_feeds(recipe, recipe.accuracy.samples).by_scenario[scenario]
    chosen = variants(report)
    metric = report.settings.accuracy_metric or "cosine"
    with ExitStack() as stack:
        sessions = {label: [stack.enter_context(runner_for(art, recipe).load()) for _ in range(instances)]
                    for label, (art, _) in chosen.items()}
        inputs = {label: [[s.prepare(f) for f in feeds.samples] for s in twins] for label, twins in sessions.items()}
        timed, used = interleaved_twin_rounds(sessions, inputs, rounds, iterations, parent=BASE)
    rows = [f"\n## {scenario}: {len(feeds.samples)} inputs in turn, {rounds} interleaved rounds x {iterations} "
            f"calls, {instances} sessions a variant\n",
            f"| variant | P50 ms | vs {BASE} (95% CI) | {metric} vs stage 0 (budget) |", "|---|---|---|---|"]
    for label, (_, stage) in chosen.items():
        p50 = float(np.median([x for r in timed[label] for x in r]))
        s = speedup_with_spread(timed, used, BASE, label)
        rows.append(f"| {label} | {p50:.2f} | {s.ratio:.2f}x ({s.low:.2f}-{s.high:.2f}) | {_accuracy(stage, metric)} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--scenario", action="append", help="repeat for several (default: b1-s128 and b1-s512)")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--instances", type=int, default=2)
    args = ap.parse_args()
    report = read_report(args.run / "report.json")
    data = json.loads((args.run / "report.json").read_text())
    recipe = parse_recipe(data["recipe"], str(args.run / "report.json"), Path(data["recipe_dir"]))
    for scenario in args.scenario or ["b1-s128", "b1-s512"]:
        for row in bench(recipe, report, scenario, args.rounds, args.iterations, max(1, args.instances)):
            print(row, flush=True)


if __name__ == "__main__":
    main()
