"""Quantization benchmark: FP32 ONNX export vs int8_dynamic vs hybrid, interleaved in one run, with accuracy.

Uses the stages of `optimizer compile recipes/minilm-cpu.yaml` (run it first; this script builds any that are
missing, measuring nothing). All three run in ONNX Runtime on the CPU with session optimizations on, batch 1,
each scenario of the recipe. Accuracy is the pipeline's: cosine against stage 0 on the held-out sentences
(not the calibration ones), over all token states and over the mean-pooled sentence embedding.

    python scripts/bench_quantize.py [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from optimizer.benchmark import interleaved_p50
from optimizer.inputs import build_feeds
from optimizer.pipeline import Pipeline
from optimizer.recipe import load_recipe
from optimizer.runners.ort_runner import OrtRunner

# The FP32 export is timed with ORT's session optimizations on (the ort_session stage: same graph).
VARIANTS = {"fp32 export": "ort_session", "int8_dynamic": "int8_dynamic", "hybrid": "hybrid"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/minilm-cpu.yaml")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    recipe = load_recipe(args.recipe)
    out = Path("runs") / recipe.name
    records = {r.name: r for r in Pipeline(recipe, out, measure=False).execute()}
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {"stages": []}
    accuracy = {s["name"]: (s.get("metrics") or {}).get("accuracy", {}) for s in report["stages"]}
    sessions = {v: OrtRunner(records[stage].artifact, recipe).load().__enter__() for v, stage in VARIANTS.items()}
    print("| scenario | " + " | ".join(f"{v} P50 ms" for v in VARIANTS) + " | int8_dynamic vs fp32 | hybrid vs fp32 |")
    print("|---|" + "---|" * (len(VARIANTS) + 2))
    for sf in build_feeds(recipe, 1):
        prepared = {v: s.prepare(sf.timing) for v, s in sessions.items()}
        p50 = interleaved_p50(sessions, prepared, args.rounds, 10)
        base = p50["fp32 export"]
        print(
            f"| {sf.scenario.name} | "
            + " | ".join(f"{p50[v]:.2f}" for v in VARIANTS)
            + f" | {base / p50['int8_dynamic']:.2f}x | {base / p50['hybrid']:.2f}x |",
            flush=True,
        )
    print("\nAccuracy against stage 0 on held-out sentences (from the last compile's report.json):")
    for v, stage in VARIANTS.items():
        acc = next(iter(accuracy.get(stage, {}).values()), {})
        if acc:
            print(f"- {v}: cosine {acc['cosine']:.4f}, mean-pooled cosine {acc.get('pooled_cosine', float('nan')):.4f}")


if __name__ == "__main__":
    main()
