"""Why the harness pauses at each switch: how long ONNX Runtime's spinning worker threads slow the other session.

Two sessions of a compiled run (the FP32 ORT session and the fused graph) on b1-natural inputs: the parent runs 5
calls, then after a pause of 0 / 2 / 10 / 50 / 200 ms the child runs 10 timed calls; medians per call position
over 10 repeats. Compile the main job first.

    python benchmarks/bench_settle.py [runs/minilm-cpu]

Question: how long ONNX Runtime's spinning threads slow the other session (why `settle_ms` is 50).
Written up in: docs/measurement.md (the harness).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.recipe.loading import parse_recipe
from optimizer.runtime.inputs import build_feeds
from optimizer.runtime.runners.ort_runner import OrtRunner


def main() -> None:
    run = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/minilm-cpu")
    report = json.loads((run / "report.json").read_text())
    recipe = parse_recipe(report["recipe"], str(run / "report.json"), Path(report["recipe_dir"]))
    stages = {s["name"]: s for s in report["stages"]}
    feeds = build_feeds(recipe, 4).by_scenario["b1-natural"].samples[:4]
    parent_art, child_art = (Artifact.from_json(stages[n]["artifact"]) for n in ("ort_session", "fuse"))
    with OrtRunner(parent_art, recipe).load() as parent, OrtRunner(child_art, recipe).load() as child:
        pp, cp = [parent.prepare(f) for f in feeds], [child.prepare(f) for f in feeds]
        for _ in range(20):
            parent.run(pp[0])
            child.run(cp[0])
        print("pause ms | child call 1..10 after the parent, median ms over 10 repeats")
        for pause in (0.0, 0.002, 0.01, 0.05, 0.2):
            rows = []
            for _ in range(10):
                for _ in range(5):
                    parent.run(pp[0])
                time.sleep(pause)
                times = []
                for i in range(10):
                    t0 = time.perf_counter()
                    child.run(cp[i % 4])
                    times.append((time.perf_counter() - t0) * 1000)
                rows.append(times)
            print(f"{pause * 1000:6.0f} | " + " ".join(f"{x:5.2f}" for x in np.median(np.array(rows), 0)))


if __name__ == "__main__":
    main()
