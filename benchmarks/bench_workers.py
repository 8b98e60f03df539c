"""N recipes compiled serially and with `--workers W` (the local pool): wall times, whether any two timed windows
overlapped on a host (from the reports), and whether both gave the same verdicts.

    python benchmarks/bench_workers.py                      # 4 small CNN recipes (optimizer.runtime.zoo), workers 2
    python benchmarks/bench_workers.py --recipes 2 --width 8  # the smallest setting: a check that it all works

Verdicts compared: each recipe's outcome, each stage's status, the best stage, and each stage's faster/slower
verdict against its parent (a verdict "within noise" on one side and faster/slower on the other is reported as a
flip; the noisy machine can cause it, a different status cannot). Exit code 1 when windows overlapped or statuses
or outcomes differ.

Question: whether `--workers` gives a serial run's verdicts with no two timed windows overlapping.
Written up in: docs/workflows.md#many-models-at-once.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from optimizer.report.schema import RunReport, read_report
from optimizer.report.windows import overlapping_windows, report_windows


def recipe(i: int, width: int, rounds: int) -> dict[str, Any]:
    """A small ResNet (optimizer.runtime.zoo), different per recipe: export, ORT session, fusion."""
    return {
        "name": f"bench-workers-{i}",
        "model": {"source": "factory", "target": "optimizer.runtime.zoo:resnet",
                  "kwargs": {"layers": [1, 1, 1, 1], "width": width, "classes": 10, "seed": i}},
        "inputs": [{"name": "pixel_values", "dtype": "float32", "shape": ["batch", 3, 32 + 8 * i, 32 + 8 * i]}],
        "scenarios": [{"name": "b1", "batch": 1, "seq": 1}],
        "target": {"device": "cpu", "threads": 1},
        "benchmark": {"warmup": 2, "rounds": rounds, "iterations": 5, "memory": "inline"},
        "accuracy": {"metric": "cosine", "min": 0.99, "samples": 2},
        "passes": [{"type": "export"}, {"type": "ort_session"}, {"type": "fuse"}],
    }


def compile_all(folder: Path, out: Path, history: Path, workers: int) -> float:
    cmd = [sys.executable, "-m", "optimizer.cli.app", "--history", str(history), "compile", str(folder), "--out",
           str(out), "--workers", str(workers), "--no-cache"]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode not in (0, 1):
        sys.exit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return wall


def verdicts(report: RunReport) -> dict[str, Any]:
    stages = {}
    for st in report.stages:
        ratios = st.metrics.scenarios if st.metrics is not None else {}
        stages[st.name] = (st.status, {k: v.vs_parent.verdict for k, v in ratios.items() if v.vs_parent})
    return {"outcome": report.outcome, "best": report.best.stage if report.best else None, "stages": stages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--width", type=int, default=32, help="the ResNets' first width (8: tiny)")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        root = Path(tmp)
        folder = root / "recipes"
        folder.mkdir()
        for i in range(args.recipes):
            (folder / f"r{i}.yaml").write_text(yaml.safe_dump(recipe(i, args.width, args.rounds), sort_keys=False))
        walls = {}
        for label, workers in (("serial", 1), (f"workers {args.workers}", args.workers)):
            walls[label] = compile_all(folder, root / label.replace(" ", "-"), root / "history.sqlite", workers)
            print(f"{label:>12}: {walls[label]:7.1f} s for {args.recipes} recipes", flush=True)
        names = [f"bench-workers-{i}" for i in range(args.recipes)]
        sides = {label: [read_report(root / label.replace(" ", "-") / n / "report.json") for n in names]
                 for label in walls}
        bad = False
        for label, reports in sides.items():
            pairs = overlapping_windows(reports)
            count = sum(len(report_windows(r)) for r in reports)
            print(f"{label:>12}: {count} timed windows, {len(pairs)} overlapping on one host")
            for a, b in pairs:
                print(f"    {a.what} ({a.pid}) overlaps {b.what} ({b.pid}) on {a.host}")
            bad |= bool(pairs)
        serial, pooled = sides.values()
        flips = []
        for s, p in zip(serial, pooled, strict=True):
            vs, vp = verdicts(s), verdicts(p)
            same_status = vs["outcome"] == vp["outcome"] and {k: v[0] for k, v in vs["stages"].items()} == {
                k: v[0] for k, v in vp["stages"].items()}
            bad |= not same_status
            flips += [f"{s.recipe.name} {k}: {vs['stages'][k][1]} vs {vp['stages'][k][1]}"
                      for k in vs["stages"] if vs["stages"][k][1] != vp["stages"].get(k, (None, {}))[1]]
            if vs["best"] != vp["best"]:
                flips.append(f"{s.recipe.name} best: {vs['best']} vs {vp['best']}")
            print(f"{s.recipe.name}: statuses {'same' if same_status else 'DIFFER'}; best {vs['best']} / {vp['best']}")
        print(f"verdict flips (serial vs pool): {len(flips)}" + "".join(f"\n    {f}" for f in flips))
        print(f"speedup of the pool: {walls['serial'] / walls[f'workers {args.workers}']:.2f}x")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
