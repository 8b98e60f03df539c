"""A/A test of the in-run verdicts: stages that change nothing must read "within noise".

A chain of MatMul+Relu layers (calls of about a millisecond or less, where sessions of one artifact differ most)
is compiled through `ort_session` and then `--copies` more `ort_session` stages, each from the one before with
the same settings: the same graph and the same session options, so any verdict other than "within noise" on
them is false. The compile runs `--runs` times with `benchmark.instances: 1` (one session a side, as before) and
as many times with 2, alternately, in one process, and the false verdicts of each setting are counted (at 95%,
about 5% of the judgements would be by chance alone).

    python benchmarks/aa_verdicts.py [--out runs/aa_verdicts] [--runs 5] [--copies 3] [--width 1024]

Question: how many false verdicts stages that change nothing get with one and with two sessions a side.
Written up in: docs/measurement.md (attribution against the parent).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimizer.engine.pipeline import Pipeline  # noqa: E402
from optimizer.recipe.loading import load_recipe  # noqa: E402
from optimizer.report.build import build_report  # noqa: E402


def chain(path: Path, width: int, layers: int = 6) -> None:
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        x = f"r{i}"
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", width])], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def recipe(folder: Path, width: int, copies: int, instances: int) -> Path:
    passes = [{"type": "ort_session", "name": "same_0"}]
    passes += [{"type": "ort_session", "name": f"same_{i}", "from": f"same_{i - 1}"} for i in range(1, copies + 1)]
    data = {
        "name": f"aa-verdicts-{instances}",
        "model": {"source": "onnx", "path": str(folder / "chain.onnx")},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", width]}],
        "scenarios": [{"name": "b1", "batch": 1}, {"name": "b8", "batch": 8}],
        "target": {"device": "cpu", "threads": 1},
        "benchmark": {"warmup": 3, "rounds": 10, "iterations": 10, "memory": "inline", "instances": instances},
        "passes": passes,
    }
    path = folder / f"recipe-{instances}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("runs/aa_verdicts"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--width", type=int, default=1024)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chain(args.out / "chain.onnx", args.width)
    false: dict[int, list[str]] = {1: [], 2: []}
    judged: dict[int, int] = {1: 0, 2: 0}
    for run in range(args.runs):
        for instances in (1, 2) if run % 2 == 0 else (2, 1):
            rec = load_recipe(recipe(args.out, args.width, args.copies, instances))
            folder = args.out / f"run{run}-instances{instances}"
            records = Pipeline(rec, folder, use_cache=False).execute()
            report = build_report(rec, records, folder, 0.0)
            for st in report.stages:
                if not st.name.startswith("same_") or st.name == "same_0" or st.metrics is None:
                    continue
                for scen, m in st.metrics.scenarios.items():
                    vs = m.vs_parent
                    if vs is None:
                        continue
                    judged[instances] += 1
                    if vs.verdict != "within noise":
                        false[instances].append(f"run {run} {st.name} {scen}: {vs.ratio:.3f}x ({vs.low:.3f}-"
                                                f"{vs.high:.3f}) {vs.verdict}")
            print(f"run {run}, instances {instances}: {len(false[instances])} false of {judged[instances]} so far",
                  flush=True)
    for instances in (1, 2):
        n, k = judged[instances], len(false[instances])
        print(f"\ninstances {instances}: {k} false verdicts of {n} judgements ({k / max(n, 1):.0%}) on unchanged "
              "stages")
        for line in false[instances]:
            print("  " + line)


if __name__ == "__main__":
    main()
