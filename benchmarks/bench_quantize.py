"""Quantization benchmark: the FP32 export and the FP32 ort_session stage against each run's best stage and every
quantize stage of the first run, interleaved in one process, on every sample of each scenario, with the accuracy
the pipeline judged; then, per scenario, the fastest stage within the budget against both FP32 baselines.

Takes run folders of `optimizer compile recipes/minilm-cpu.yaml` (compile twice with --no-cache to see that two
runs pick stages of the same speed): all stages run in ONNX Runtime on the CPU with the recipe's threads. "fp32" is
the first run's ort_session stage (the export with ORT's own optimizations on: the fair FP32 baseline); "export"
is the export stage as it was written. Accuracy is from each run's report.json: the budget's metric on the
positions the attention mask keeps, against stage 0, on held-out sentences (calibration takes others).

    python benchmarks/bench_quantize.py runs/q1 runs/q2 [--scenario b1-s128 --scenario b1-s512] [--rounds 20]

Question: how fast each quantize stage is against the FP32 baselines, interleaved in one process.
Written up in: docs/quantization.md.
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack
from pathlib import Path

from optimizer.core.artifact import Artifact
from optimizer.core.metrics import Speedup
from optimizer.measure.harness import interleaved_twin_rounds
from optimizer.measure.stats import speedup_with_spread
from optimizer.recipe.loading import parse_recipe
from optimizer.recipe.schema import Recipe
from optimizer.runtime.inputs import build_feeds
from optimizer.runtime.runners.ort_runner import OrtRunner

GOAL = 2.5  # issue 16: the best stage within budget, this many times the FP32 baseline at b1-s128 and b1-s512
FP32, EXPORT = "fp32 (ort_session)", "export"


def stage(report: dict, name: str) -> dict | None:
    return next((s for s in report["stages"] if s["name"] == name), None)


def variants_of(reports: list[dict]) -> dict[str, dict]:
    """Name -> stage record: the two FP32 baselines, each run's best, and run 1's quantize stages that ran."""
    first = reports[0]
    out: dict[str, dict] = {}
    for name, label in (("ort_session", FP32), ("export", EXPORT)):
        found = stage(first, name)
        if found is None:
            raise SystemExit(f"{first['run_dir']}: no {name} stage to compare with")
        out[label] = found
    for i, rep in enumerate(reports, 1):
        best = stage(rep, rep["best"]["stage"])
        if best is not None:
            out[f"run {i} best: {best['name']}"] = best
    for st in first["stages"]:
        ran = st.get("type") == "quantize" and st.get("status") == "ran" and st.get("artifact")
        if ran and st["name"] != first["best"]["stage"]:  # run 1's best is already there
            out[f"run 1 {st['name']}"] = st
    return out


def bench_scenario(
    recipe: Recipe, variants: dict[str, dict], scenario: str, rounds: int, iterations: int, metric: str,
    instances: int,
) -> None:
    feeds = build_feeds(recipe, recipe.accuracy.samples).by_scenario[scenario]
    with ExitStack() as stack:
        sessions = {
            v: [stack.enter_context(OrtRunner(Artifact.from_json(st["artifact"]), recipe).load())
                for _ in range(instances)]
            for v, st in variants.items()
        }
        inputs = {v: [[s.prepare(f) for f in feeds.samples] for s in twins] for v, twins in sessions.items()}
        timed, used = interleaved_twin_rounds(sessions, inputs, rounds, iterations, parent=FP32)
    print(
        f"\n## {scenario}: {len(feeds.samples)} inputs timed in turn, {rounds} interleaved rounds x {iterations} "
        f"calls, {instances} sessions a variant taken in turn (intervals widened by their spread); accuracy = "
        f"{metric} on kept positions vs stage 0 (held-out sentences)\n"
    )
    print("| variant | P50 ms | vs fp32 ort_session (95% CI) | vs export (95% CI) | accuracy (worst / mean) | "
          "pooled cosine | budget |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    best: tuple[float, str, Speedup, Speedup] | None = None
    for v, st in variants.items():
        rounds_v = timed[v]
        p50 = sorted(x for r in rounds_v for x in r)[len(rounds_v) * iterations // 2]
        s, e = speedup_with_spread(timed, used, FP32, v), speedup_with_spread(timed, used, EXPORT, v)
        acc = next(iter(st["metrics"]["accuracy"].values()))
        ok = st["metrics"]["within_budget"]
        print(
            f"| {v} | {p50:.2f} | {s.ratio:.2f}x ({s.low:.2f}-{s.high:.2f}) | "
            f"{e.ratio:.2f}x ({e.low:.2f}-{e.high:.2f}) | "
            f"{acc.get(metric, acc['cosine']):.4f} / {acc.get(metric + '_mean', acc['cosine']):.4f} | "
            f"{acc.get('pooled_cosine', float('nan')):.4f} | {'ok' if ok else 'REJECTED'} |",
            flush=True,
        )
        if ok and v not in (FP32, EXPORT) and (best is None or s.ratio > best[0]):
            best = (s.ratio, v, s, e)
    if best is None:
        print(f"\n{scenario}: no quantized stage within the budget")
        return
    _, v, s, e = best
    met = "meets" if s.low >= GOAL and e.low >= GOAL else "does not meet"
    print(
        f"\n{scenario}: fastest within budget = {v}: {s.ratio:.2f}x the FP32 ort_session ({s.low:.2f}-{s.high:.2f}), "
        f"{e.ratio:.2f}x the export ({e.low:.2f}-{e.high:.2f}); {met} the {GOAL}x goal at 95% confidence"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders of the main job")
    ap.add_argument("--scenario", action="append", help="repeat for several (default: b1-s128 and b1-s512)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--instances", type=int, default=2, help="sessions a variant, taken in turn (1: one each)")
    args = ap.parse_args()
    reports = [json.loads((r / "report.json").read_text()) for r in args.runs]
    first = reports[0]
    recipe = parse_recipe(first["recipe"], str(args.runs[0] / "report.json"), Path(first["recipe_dir"]))
    variants = variants_of(reports)
    metric = first["settings"].get("accuracy_metric", "cosine")
    for scenario in args.scenario or ["b1-s128", "b1-s512"]:
        bench_scenario(recipe, variants, scenario, args.rounds, args.iterations, metric, max(1, args.instances))
    for i, rep in enumerate(reports, 1):
        print(f"\nrun {i} ({rep['run_dir']}): best = {rep['best']['why']}")


if __name__ == "__main__":
    main()
