"""Generation layout checks, side by side in one run, on the export stage of a generation recipe (CPU):

1. the two graphs over one shared weights file (what export writes) vs each graph carrying its weights:
   bytes on disk, resident-set growth of a fresh process that loads both sessions, and task time;
2. the plain numpy loop vs the IO-binding loop (what the CUDA EP uses), on the same sessions.

Times are medians of interleaved generations (A, B, A, B...), so drift hits both sides alike. The stage is built
if missing (nothing measured).

    python benchmarks/bench_generation_layout.py [--recipe recipes/gpt2-cpu.yaml] [--runs 20]

Question: one shared weights file against weights per graph, and the numpy loop against IO binding.
Written up in: docs/generation.md (the workload).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import load_recipe
from optimizer.runtime import onnx_io
from optimizer.runtime.generation import OrtBoundGenerator, OrtGenerator
from optimizer.runtime.inputs import build_feeds

LOAD_BOTH = """
import sys, psutil, onnxruntime as ort
p = psutil.Process(); before = p.memory_info().rss
so = ort.SessionOptions(); so.intra_op_num_threads = 1
sessions = [ort.InferenceSession(f, so, providers=["CPUExecutionProvider"]) for f in sys.argv[1:]]
print((p.memory_info().rss - before) / 2**20)
"""


def sessions(folder: Path, prefill: str, threads: int) -> tuple[object, object]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return tuple(  # type: ignore[return-value]
        ort.InferenceSession(str(folder / f), so, providers=["CPUExecutionProvider"]) for f in (prefill, "decode.onnx")
    )


def interleaved(a: object, b: object, prompt: np.ndarray, new: int, runs: int) -> tuple[float, float]:
    ta, tb = [], []
    for g in (a, b):  # warm-up
        g.generate(prompt, new, keep_logits=False)  # type: ignore[attr-defined]
    for _ in range(runs):
        ta.append(a.generate(prompt, new, keep_logits=False).e2e_ms)  # type: ignore[attr-defined]
        tb.append(b.generate(prompt, new, keep_logits=False).e2e_ms)  # type: ignore[attr-defined]
    return float(np.median(ta)), float(np.median(tb))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/gpt2-cpu.yaml")
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    recipe = load_recipe(args.recipe)
    records = {r.name: r for r in Pipeline(recipe, Path("runs") / recipe.name, measure=False).execute()}
    export = records["export"].artifact
    shared_dir, prefill = export.path.parent, export.path.name
    layers = export.decoder_layers()
    separate_dir = Path(tempfile.mkdtemp())
    for name in (prefill, "decode.onnx"):
        onnx_io.save(onnx_io.load(shared_dir / name), separate_dir / name)
    threads = recipe.target.threads or 2

    def disk(folder: Path) -> float:
        return sum(f.stat().st_size for f in folder.iterdir() if f.suffix in (".onnx", ".bin", ".data")) / 2**20

    def rss(folder: Path) -> float:
        files = [str(folder / prefill), str(folder / "decode.onnx")]
        return float(subprocess.run([sys.executable, "-c", LOAD_BOTH, *files], capture_output=True, text=True,
                                    check=True).stdout)  # fmt: skip

    print(f"{recipe.name} export, {layers} layers, {threads} threads, medians of {args.runs} interleaved runs")
    print(f"disk: shared {disk(shared_dir):.1f} MB, separate {disk(separate_dir):.1f} MB")
    print(f"both sessions loaded (fresh process, RSS growth): shared {rss(shared_dir):.0f} MB, "
          f"separate {rss(separate_dir):.0f} MB")  # fmt: skip
    shared = OrtGenerator(*sessions(shared_dir, prefill, threads), layers)
    separate = OrtGenerator(*sessions(separate_dir, prefill, threads), layers)
    bound = OrtBoundGenerator(shared.prefill, shared.decode, layers, "cpu")
    print("| scenario | shared ms | separate ms | ratio | numpy loop ms | IO-binding loop ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    for sf in build_feeds(recipe, 1, per_scenario=False):
        prompt, new = sf.timing["input_ids"], sf.scenario.new_tokens
        s, p = interleaved(shared, separate, prompt, new, args.runs)
        n, b = interleaved(shared, bound, prompt, new, args.runs)
        print(f"| {sf.scenario.name} | {s:.1f} | {p:.1f} | {p / s:.3f} | {n:.1f} | {b:.1f} | {b / n:.3f} |")


if __name__ == "__main__":
    main()
