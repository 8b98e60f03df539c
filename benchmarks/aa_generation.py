"""A/A test of the generation verdicts: stages that change nothing must read "within noise".

The llama-cpu model (4 layers, random weights) in GenAI's layout, then `--copies` more `ort_session` stages, each
from the one before with the same settings (same graph, same session options), so any verdict other than
"within noise" on them is false. Compiled `--runs` times; the false verdicts on task time and on TPOT are counted
(at 95%, about 5% of the judgements would be by chance alone). Before generation timing settled the switch
between sides (as forward timing does), a stage timed right after its parent paid for the parent's spinning pool.

    python benchmarks/aa_generation.py [--out runs/aa_generation] [--runs 2] [--copies 3]

Question: how many false verdicts generation stages that change nothing get.
Written up in: docs/measurement.md (the harness).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimizer.engine.pipeline import Pipeline  # noqa: E402
from optimizer.recipe.loading import load_recipe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def recipe(copies: int) -> dict:
    data = yaml.safe_load((ROOT / "recipes" / "llama-cpu.yaml").read_text())
    data["name"] = "aa-generation"
    data["scenarios"] = [{"preset": "low_latency_inference"}, {"preset": "short_text_generation"}]
    passes = [{"type": "genai_build", "name": "genai", "from": "source"}]
    for i in range(copies):
        passes.append({"type": "ort_session", "name": f"same_{i}", "from": passes[-1].get("name", "genai"),
                       "config": {"graph_optimization_level": "all"}})
    data["passes"] = passes
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/aa_generation"))
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--copies", type=int, default=3)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(args.copies), sort_keys=False))
    judged, false = {"task": 0, "tpot": 0}, {"task": [], "tpot": []}
    for run in range(args.runs):
        records = Pipeline(load_recipe(path), args.out / f"run{run}", use_cache=False).execute()
        for rec in records:
            if not rec.name.startswith("same_") or not rec.metrics:
                continue
            for scen, m in rec.metrics["scenarios"].items():
                for what, key in (("task", "vs_parent"), ("tpot", "tpot_vs_parent")):
                    v = m.get(key)
                    if not v:
                        continue
                    judged[what] += 1
                    if v["verdict"] != "within noise":
                        false[what].append(f"run {run} {rec.name} {scen}: {v['ratio']:.3f}x "
                                           f"({v['low']:.3f}-{v['high']:.3f}) {v['verdict']}")
    for what in ("task", "tpot"):
        print(f"{what}: {len(false[what])} false verdicts of {judged[what]} judged (95% each)")
        for line in false[what]:
            print("  " + line)


if __name__ == "__main__":
    main()
