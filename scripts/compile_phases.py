"""Where a compile's wall time went, per stage and phase, from its report.json (one run, or two side by side:
before and after a change).

    python scripts/compile_phases.py RUN [RUN2]

Per stage: the pass itself (building the artifact), and its measurement split into the harness's steps
(load, accuracy, time, profile, memory; `other` is what the steps do not cover) when the run recorded them
(`metrics.phase_seconds`). The last rows: the sum over stages, what the run spent outside any stage (stage 0's
reference, the batch sweep, the report) and the run's wall time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

STEPS = ("load", "accuracy", "time", "profile", "memory")


def phases(stage: dict[str, Any]) -> dict[str, float]:
    """Seconds per phase of one stage (pass, the measurement's steps, or `measure` when not split)."""
    out = {"pass": float(stage.get("pass_seconds") or 0.0)}
    bench = float(stage.get("bench_seconds") or 0.0)
    split = ((stage.get("metrics") or {}).get("phase_seconds")) or {}
    for step in STEPS if split else ():
        out[step] = float(split.get(step, 0.0))
    covered = sum(out.get(s, 0.0) for s in STEPS)
    out["other" if split else "measure"] = max(bench - covered, 0.0)
    return out


def table(report: dict[str, Any]) -> tuple[list[str], dict[str, dict[str, float]], float]:
    rows = {s["name"]: phases(s) for s in report["stages"] if s.get("status") in ("ran", "cached", "unchanged")}
    columns = sorted({c for r in rows.values() for c in r}, key=lambda c: (["pass", *STEPS, "other",
                                                                              "measure"].index(c)))
    return columns, rows, float(report.get("wall_seconds") or 0.0)


def render(run: Path) -> tuple[list[str], dict[str, dict[str, float]], float]:
    return table(json.loads((run / "report.json").read_text()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, nargs="+", help="one or two run folders")
    args = ap.parse_args()
    for run in args.runs:
        columns, rows, wall = render(run)
        total = {c: sum(r.get(c, 0.0) for r in rows.values()) for c in columns}
        staged = sum(total.values())
        print(f"\n{run}: wall {wall:.0f} s")
        print("| stage | " + " | ".join(columns) + " | stage total |")
        print("|---|" + "---|" * (len(columns) + 1))
        for name, r in rows.items():
            print(f"| {name} | " + " | ".join(f"{r.get(c, 0.0):.1f}" for c in columns) + f" | {sum(r.values()):.1f} |")
        print("| **all stages** | " + " | ".join(f"{total[c]:.0f}" for c in columns) + f" | {staged:.0f} |")
        blank = "|" * len(columns)
        print(f"| outside stages (stage 0's reference, batch sweep, report) |{blank}{max(wall - staged, 0):.0f} |")
        shares = ", ".join(f"{c} {total[c] / wall:.0%}" for c in columns if wall and total[c] > 0)
        print(f"share of wall time: {shares}")


if __name__ == "__main__":
    main()
