"""Fusion benchmark: unfused ONNX vs ORT's transformers optimizer vs our `fuse` pass, interleaved in one run.

All three run in ONNX Runtime on the CPU with session optimizations on (level all), batch 1, at sequence
128 and 512 (all-MiniLM-L6-v2, real weights, real sentences) and 2048 (the same architecture built from its
config with 2048 positions and random weights: MiniLM itself stops at 512). The sessions take turns round by
round, so machine drift falls on all three alike.

    python benchmarks/bench_fusion.py [--rounds 8] [--out runs/bench-fusion]

Question: how our `fuse` compares with ORT's transformers optimizer and the unfused graph at s128, s512 and s2048.
Written up in: docs/fusion.md.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import yaml

from optimizer.core.artifact import Artifact
from optimizer.engine.pipeline import Pipeline
from optimizer.measure.harness import interleaved_p50
from optimizer.recipe.loading import load_recipe, parse_recipe
from optimizer.runtime.inputs import build_feeds
from optimizer.runtime.runners.ort_runner import OrtRunner

VARIANTS = {"unfused": "ort_session", "ort_optimizer": "ort_transformers", "ours": "fuse"}


def long_recipe(base: dict) -> dict:
    data = copy.deepcopy(base)
    data["name"] = "minilm-shaped-2048"
    data["model"] = {
        "source": "hf_config",
        "architecture": "bert",
        "config": {
            "hidden_size": 384,
            "num_hidden_layers": 6,
            "num_attention_heads": 12,
            "intermediate_size": 1536,
            "max_position_embeddings": 2048,
            "vocab_size": 30522,
        },
    }
    data.pop("text")
    data["inputs"] = [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, 30522]},
        {"name": "attention_mask", "dtype": "int64", "shape": ["batch", "seq"], "fill": "ones"},
        {"name": "token_type_ids", "dtype": "int64", "shape": ["batch", "seq"], "fill": "zeros"},
    ]
    data["scenarios"] = [{"name": "b1-s2048", "batch": 1, "seq": 2048}]
    return data


def build(recipe, out: Path) -> dict[str, Artifact]:  # type: ignore[no-untyped-def]
    records = Pipeline(recipe, out, measure=False).execute()
    by_name = {r.name: r for r in records}
    bad = [f"{r.name}: {r.reason}" for r in records if not r.ok]
    if bad:
        raise SystemExit("could not build: " + "; ".join(bad))
    return {v: by_name[stage].artifact for v, stage in VARIANTS.items()}  # type: ignore[misc]


def compare(recipe, artifacts: dict[str, Artifact], rounds: int, iterations: int) -> None:  # type: ignore[no-untyped-def]
    feeds = build_feeds(recipe, 1, per_scenario=False)
    sessions = {v: OrtRunner(a, recipe).load().__enter__() for v, a in artifacts.items()}
    for sf in feeds:
        prepared = {v: s.prepare(sf.timing) for v, s in sessions.items()}
        p50 = interleaved_p50(sessions, prepared, rounds, iterations)
        print(
            f"| {sf.scenario.name} | "
            + " | ".join(f"{p50[v]:.1f}" for v in VARIANTS)
            + f" | {p50['unfused'] / p50['ours']:.2f}x | {p50['ort_optimizer'] / p50['ours']:.2f}x |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", default="runs/bench-fusion")
    args = ap.parse_args()
    recipe = load_recipe("recipes/minilm-fusion.yaml")
    raw = yaml.safe_load(Path("recipes/minilm-fusion.yaml").read_text())
    long = parse_recipe(long_recipe(raw), "benchmarks/bench_fusion.py", Path("recipes").resolve())
    out = Path(args.out)
    print(
        "| scenario | unfused P50 ms | ORT optimizer P50 ms | ours P50 ms | ours vs unfused | ours vs ORT optimizer |"
    )
    print("|---|---|---|---|---|---|")
    compare(recipe, build(recipe, out / "minilm"), args.rounds, 5)
    compare(long, build(long, out / "long"), max(2, args.rounds // 2), 2)


if __name__ == "__main__":
    main()
