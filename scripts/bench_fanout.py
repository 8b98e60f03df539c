"""The hybrid search's per-node INT8 sensitivities serially and over N workers (ctx.map): wall times and whether the
numbers are equal. A short probe, e.g. on the MiniLM export of a run:

    python scripts/bench_fanout.py recipes/minilm-cpu.yaml runs/minilm-cpu/01-export/model.onnx --nodes 12 --workers 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from functools import partial
from pathlib import Path

from optimizer.core.pass_base import PassContext
from optimizer.measure.services import MeasureServices
from optimizer.recipe.loading import load_recipe
from optimizer.runtime import onnx_io
from optimizer.runtime.inputs import build_feeds
from passes.quantize import hybrid


def sensitivities(recipe_path: Path, model: Path, nodes: int, workers: int, samples: int) -> tuple[dict, float]:
    recipe = load_recipe(recipe_path)
    feeds = build_feeds(recipe, samples)
    search_feeds = [f for sf in feeds for f in sf.samples][:samples]
    names = [n.name for n in onnx_io.load(model).graph.node if n.op_type == "MatMul" and n.name][:nodes]
    with tempfile.TemporaryDirectory() as tmp:
        ctx = PassContext(recipe, "probe", Path(tmp), feeds, MeasureServices(workers))
        evaluator = hybrid.Evaluator(model, search_feeds, [], ctx, {}, "cosine")
        start = time.perf_counter()
        single = partial(hybrid.int8_sensitivity, evaluator, model, Path(tmp), True, ["MatMul"])
        out = dict(zip(names, ctx.map(single, list(enumerate(names))), strict=True))
        return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", type=Path)
    parser.add_argument("model", type=Path, help="an ONNX graph of the recipe's model (e.g. its export stage)")
    parser.add_argument("--nodes", type=int, default=12)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    args = parser.parse_args()
    serial, serial_s = sensitivities(args.recipe, args.model, args.nodes, 1, args.samples)
    pooled, pooled_s = sensitivities(args.recipe, args.model, args.nodes, args.workers, args.samples)
    print(json.dumps({"nodes": len(serial), "serial_s": round(serial_s, 2), f"workers_{args.workers}_s":
                      round(pooled_s, 2), "speedup": round(serial_s / pooled_s, 2), "equal": serial == pooled}))


if __name__ == "__main__":
    main()
