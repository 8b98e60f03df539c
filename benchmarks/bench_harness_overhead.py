"""How much the benchmark harness adds to what it measures.

One ONNX Runtime session, two ways of timing it, interleaved block by block in one process:
  harness: optimizer.measure.harness.time_calls through the OrtSession wrapper (what every stage gets);
  bare:    a plain loop of perf_counter() around session.run(None, feed).
Prints both P50s and their difference; the goal is a harness P50 within 3% of the bare loop's.

    python benchmarks/bench_harness_overhead.py [--recipe R.yaml] [--model runs/minilm-cpu/02-ort_session/model.onnx]

Question: how much the harness adds to the latency it measures.
Written up in: docs/measurement.md (harness overhead).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.measure.harness import time_calls
from optimizer.recipe.loading import load_recipe
from optimizer.runtime.inputs import build_feeds
from optimizer.runtime.runners.ort_runner import OrtRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/minilm-cpu.yaml")
    ap.add_argument("--model", default="runs/minilm-cpu/02-ort_session/model.onnx")
    ap.add_argument("--level", default="all", help="ORT graph optimization level")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--iterations", type=int, default=20)
    args = ap.parse_args()
    model = Path(args.model)
    if not model.is_file():
        raise SystemExit(f"{model}: no such model; run `optimizer compile {args.recipe}` first")
    recipe = load_recipe(args.recipe)
    feeds = build_feeds(recipe, 1, per_scenario=False)
    artifact = Artifact("onnx", model, {"graph_optimization_level": args.level})
    with OrtRunner(artifact, recipe).load() as session:
        raw = session.session  # the very same InferenceSession, called directly
        for sf in feeds:
            feed = session.prepare(sf.timing)
            time_calls(session, feed, 10)  # warm-up
            harness: list[float] = []
            bare: list[float] = []
            for r in range(args.rounds):
                blocks = ("harness", "bare") if r % 2 == 0 else ("bare", "harness")
                for block in blocks:
                    if block == "harness":
                        harness += time_calls(session, feed, args.iterations)
                    else:
                        for _ in range(args.iterations):
                            t0 = time.perf_counter()
                            raw.run(None, feed)
                            bare.append((time.perf_counter() - t0) * 1000)
            h, b = float(np.median(harness)), float(np.median(bare))
            print(
                f"{sf.scenario.name}: harness P50 {h:.3f} ms, bare loop P50 {b:.3f} ms, "
                f"difference {100 * (h - b) / b:+.2f}% ({len(harness)} calls each, interleaved)"
            )


if __name__ == "__main__":
    main()
