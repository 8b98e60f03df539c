"""Did a change alter what a compile decided? Two runs of one recipe, compared on what must not move when only
code structure or timing changed: each stage's status and budget verdict, the fused ops, the INT8 node set a
hybrid chose (and the FP32 one), the kernel choices, the quantization ops, and the best stage overall and per
scenario. Latencies are left out on purpose (they differ run to run: `optimizer diff` judges those).

Some facts are choices made by timing (marked "timed": a kernel kept or left out, the INT8 set a hybrid search
picked, the best stage among stages within noise of each other): two runs of the same code can differ there when
the timings they rest on are within noise. Run it on two runs of the same code too (an A/A) to see how much.

    python scripts/same_behaviour.py RUN_BEFORE RUN_AFTER

Prints one line per compared fact ("same" or both values) and exits 1 when a fact not decided by timing differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def facts(report: dict[str, Any]) -> dict[str, Any]:
    """What a run decided, keyed by a readable label."""
    out: dict[str, Any] = {"stages": [s["name"] for s in report["stages"]]}
    for s in report["stages"]:
        name, notes, metrics = s["name"], s.get("notes") or {}, s.get("metrics") or {}
        out[f"{name}: status"] = s.get("status")
        out[f"{name}: within budget"] = metrics.get("within_budget")
        if "fused_ops" in notes:  # timed when a kernel choice may leave a rule out
            out[f"{name}: fused_ops{' (timed)' if notes.get('kernel_choice') else ''}"] = notes["fused_ops"]
        for rule, choice in sorted((notes.get("kernel_choice") or {}).items()):
            out[f"{name}: kernel {rule} kept (timed)"] = choice.get("kept")
        for key in ("int8_nodes", "fp32_nodes", "quantization_ops"):
            if key in notes:
                value = notes[key]
                timed = " (timed)" if "int8_nodes" in notes and "search_points" in notes else ""
                out[f"{name}: {key}{timed}"] = sorted(value) if isinstance(value, list) else value
    best = report.get("best") or {}
    out["best stage (timed)"] = best.get("stage")
    for scen, pick in sorted((best.get("per_scenario") or {}).items()):
        out[f"best at {scen} (timed)"] = pick.get("stage")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path, help="run folder")
    ap.add_argument("after", type=Path, help="run folder")
    args = ap.parse_args()
    a, b = (facts(json.loads((run / "report.json").read_text())) for run in (args.before, args.after))
    differ, fixed = 0, 0
    for label in sorted(a.keys() | b.keys(), key=lambda k: (k != "stages", k)):
        left, right = a.get(label), b.get(label)
        if left == right:
            shown = right if isinstance(right, (str, bool, int, float)) or right is None else "same"
            print(f"same  {label}: {shown}")
        else:
            differ += 1
            fixed += "(timed)" not in label
            print(f"DIFF  {label}:\n        before {json.dumps(left)}\n        after  {json.dumps(right)}")
    print(f"{len(a.keys() | b.keys()) - differ} facts the same, {differ} differ ({fixed} not decided by timing)")
    sys.exit(1 if fixed else 0)


if __name__ == "__main__":
    main()
