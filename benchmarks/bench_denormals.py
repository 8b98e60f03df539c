"""Denormals on padded inputs: each stage of a run timed on padded and unpadded inputs of the same shape, with
ONNX Runtime's default and with denormal floats flushed to zero (`denormal_as_zero`), interleaved in one process.

Inputs are the recipe's own sentences through its tokenizer: "N real padded to S" is the first sentences joined
up to N tokens, padded to S (attention mask 0 on the padding, as a fixed-shape server feeds a short request);
"S real" fills all S positions with real tokens. Padded and unpadded inputs of one shape run the same arithmetic
except where masked (padded) keys make the attention probabilities denormal, so the padded/unpadded gap with
denormals kept, against that gap with them flushed, is what denormals cost. Each cell is the P50 over interleaved
rounds (every session of every column in turn, settled at each switch); "flushed gain" is default / flushed on
the same input, with its 95% bootstrap interval over rounds.

    python benchmarks/bench_denormals.py runs/minilm-cpu [--stage int8_dynamic --stage export] [--rounds 12]

Question: whether padded inputs run slower from denormal floats on this CPU, and whether flushing them helps.
Written up in: docs/measurement.md#denormals.
"""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.measure.harness import interleaved_rounds
from optimizer.measure.stats import speedup
from optimizer.recipe.loading import parse_recipe
from optimizer.recipe.schema import Recipe
from optimizer.runtime.inputs import _tokenizer
from optimizer.runtime.runners.ort_runner import OrtRunner

CASES = [(14, 128), (128, 128), (102, 512), (512, 512)]  # (real tokens, sequence length)


def feed(recipe: Recipe, real: int, seq: int) -> dict[str, np.ndarray]:
    """One request of `seq` positions whose first `real` are the recipe's sentences (joined), the rest padding."""
    tok = _tokenizer(recipe)
    assert recipe.text is not None, "the recipe has no text inputs"
    text = " ".join(recipe.resolve(recipe.text.file).read_text().split("\n") * 8)
    enc = tok([text], truncation=True, max_length=real, padding="max_length", return_tensors="np")
    names = [i.name for i in recipe.inputs]
    out = {}
    for name in names:
        arr = np.zeros((1, seq), dtype=np.int64)
        arr[:, :real] = enc[name][:, :real] if name in enc else 0
        out[name] = arr
    return out


def onnx_stages(report: dict[str, Any], names: list[str] | None) -> list[dict[str, Any]]:
    stages = [s for s in report["stages"] if s.get("artifact") and s["artifact"].get("kind") == "onnx"
              and s.get("status") in ("ran", "cached")]
    if names:
        missing = [n for n in names if n not in {s["name"] for s in stages}]
        if missing:
            raise SystemExit(f"no ONNX stage named {', '.join(missing)} in this run")
        stages = [s for s in stages if s["name"] in names]
    return stages


def bench(recipe: Recipe, stages: list[dict[str, Any]], rounds: int, iterations: int) -> list[str]:
    rows = []
    cases = [(real, seq, feed(recipe, real, seq)) for real, seq in CASES]
    for st in stages:
        art = Artifact.from_json(st["artifact"])
        runtimes = {"default": {**art.runtime, "denormal_as_zero": False},
                    "flushed": {**art.runtime, "denormal_as_zero": True}}
        with ExitStack() as stack:
            sessions = {m: stack.enter_context(OrtRunner(art.derive(runtime=rt), recipe).load())
                        for m, rt in runtimes.items()}
            cells: dict[str, str] = {}
            for real, seq, f in cases:
                prepared = {m: [s.prepare(f)] for m, s in sessions.items()}
                timed = interleaved_rounds(sessions, prepared, rounds, iterations)
                p50 = {m: float(np.median([x for r in rs for x in r])) for m, rs in timed.items()}
                gain = speedup(timed["default"], timed["flushed"])
                cells[f"{real}/{seq}"] = (f"{p50['default']:.2f} / {p50['flushed']:.2f} "
                                          f"({gain.ratio:.2f}x, {gain.low:.2f}-{gain.high:.2f})")
                print(f"  {st['name']} {real}/{seq}: {cells[f'{real}/{seq}']}", flush=True)
        rows.append(f"| {st['name']} | " + " | ".join(cells[f"{r}/{s}"] for r, s in CASES) + " |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a run folder (optimizer compile ... --out RUN)")
    ap.add_argument("--stage", action="append", help="ONNX stages to time (default: every ONNX stage that ran)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--iterations", type=int, default=5)
    args = ap.parse_args()
    report = json.loads((args.run / "report.json").read_text())
    recipe = parse_recipe(report["recipe"], str(args.run / "report.json"), Path(report["recipe_dir"]))
    rows = bench(recipe, onnx_stages(report, args.stage), args.rounds, args.iterations)
    head = " | ".join(f"{r} real{' padded' if r < s else ''} to {s}" if r < s else f"{s} real" for r, s in CASES)
    print(f"\nP50 ms, denormals kept / flushed (flushed gain, 95% CI); {args.rounds} interleaved rounds x "
          f"{args.iterations} calls, {report['settings'].get('threads', '?')} threads\n")
    print(f"| stage | {head} |")
    print("|---|" + "---|" * len(CASES))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
