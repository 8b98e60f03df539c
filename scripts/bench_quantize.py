"""Quantization benchmark: the FP32 export against each run's best stage (and int8_dynamic, hybrid), interleaved
in one process, on every sample of a scenario, with the accuracy the pipeline judged.

Takes run folders of `optimizer compile recipes/minilm-cpu.yaml` (compile twice with --no-cache to see that two
runs pick stages of the same speed): all stages run in ONNX Runtime on the CPU with the recipe's threads. "fp32" is
the first run's ort_session stage (the export with ORT's own optimizations on: the fair FP32 baseline). Accuracy
is from each run's report.json: the budget's metric on the positions the attention mask keeps, against stage 0,
on held-out sentences (calibration takes others).

    python scripts/bench_quantize.py runs/q1 runs/q2 [--scenario b1-s128] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack
from pathlib import Path

from optimizer.core.artifact import Artifact
from optimizer.measure.harness import interleaved_rounds
from optimizer.measure.stats import speedup
from optimizer.recipe.loading import parse_recipe
from optimizer.runtime.inputs import build_feeds
from optimizer.runtime.runners.ort_runner import OrtRunner


def stage(report: dict, name: str) -> dict:
    return next(s for s in report["stages"] if s["name"] == name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders of the main job")
    ap.add_argument("--scenario", default="b1-s128")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--iterations", type=int, default=10)
    args = ap.parse_args()
    reports = [json.loads((r / "report.json").read_text()) for r in args.runs]
    first = reports[0]
    recipe = parse_recipe(first["recipe"], str(args.runs[0] / "report.json"), Path(first["recipe_dir"]))
    variants: dict[str, tuple[dict, dict]] = {"fp32 (ort_session)": (first, stage(first, "ort_session"))}
    for i, rep in enumerate(reports, 1):
        best = rep["best"]["stage"]
        variants[f"run {i} best: {best}"] = (rep, stage(rep, best))
    for name in ("int8_dynamic", "hybrid"):
        variants[f"run 1 {name}"] = (first, stage(first, name))
    feeds = build_feeds(recipe, recipe.accuracy.samples).by_scenario[args.scenario]
    with ExitStack() as stack:
        sessions = {
            v: stack.enter_context(OrtRunner(Artifact.from_json(st["artifact"]), recipe).load())
            for v, (_, st) in variants.items()
        }
        inputs = {v: [s.prepare(f) for f in feeds.samples] for v, s in sessions.items()}
        timed = interleaved_rounds(sessions, inputs, args.rounds, args.iterations)
    base = timed["fp32 (ort_session)"]
    metric = first["settings"].get("accuracy_metric", "cosine")
    print(f"{args.scenario}: {len(feeds.samples)} inputs timed in turn, {args.rounds} interleaved rounds x "
          f"{args.iterations} calls; accuracy = {metric} on kept positions vs stage 0 (held-out sentences)\n")
    print("| variant | P50 ms | vs fp32 (95% CI) | accuracy (worst / mean) | pooled cosine | budget |")
    print("|---|---|---|---|---|---|")
    for v, (_, st) in variants.items():
        rounds = timed[v]
        p50 = sorted(x for r in rounds for x in r)[len(rounds) * args.iterations // 2]
        s = speedup(base, rounds)
        acc = next(iter(st["metrics"]["accuracy"].values()))
        budget = "ok" if st["metrics"]["within_budget"] else "REJECTED"
        print(
            f"| {v} | {p50:.2f} | {s.ratio:.2f}x ({s.low:.2f}-{s.high:.2f}) | "
            f"{acc.get(metric, acc['cosine']):.4f} / {acc.get(metric + '_mean', acc['cosine']):.4f} | "
            f"{acc.get('pooled_cosine', float('nan')):.4f} | {budget} |",
            flush=True,
        )
    for i, rep in enumerate(reports, 1):
        print(f"\nrun {i} ({rep['run_dir']}): best = {rep['best']['why']}")


if __name__ == "__main__":
    main()
