"""Save report.png beside a run's report.html (headless Chromium); with --chart, only that chart of the report
(rendered alone, so it is not cut off below the page): report-<kind>.png.

python scripts/screenshot_report.py runs/minilm-cpu
python scripts/screenshot_report.py runs/minilm-cpu --chart opdelta   # "why each stage's speed changed"
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from optimizer.report.html import CSS
from optimizer.report.schema import read_report
from optimizer.report.screenshot import screenshot

CHARTS = ("opdelta", "ops", "waterfall", "distribution", "accuracy")


def chart_page(run: Path, kind: str) -> tuple[Path, int, int]:
    """A page holding only the report's `kind` charts (re-rendered from report.json), and its size in pixels."""
    from optimizer.report import html

    report = read_report(run / "report.json")
    charts = {
        "opdelta": html.op_delta_chart(report),
        "ops": html.op_breakdown(report),
        "waterfall": "".join(html.waterfall(report, s) for s in report.scenario_names),
        "distribution": "".join(html.boxplots(report, s) for s in report.scenario_names),
        "accuracy": html.accuracy_chart(report),
    }[kind]
    if not charts:
        raise SystemExit(f"{run}: the report has no {kind} chart")
    width = max(int(w) for w in re.findall(r'<svg[^>]* width="(\d+)"', charts)) + 60
    height = sum(int(h) for h in re.findall(r'<svg[^>]* height="(\d+)"', charts)) + 60 * charts.count("<svg")
    page = run / f"report-{kind}.html"
    page.write_text(f"<!doctype html><html><head><meta charset='utf-8'><style>{CSS}</style></head><body>"
                    f"<h2>{report.recipe.name}</h2>{charts}</body></html>")
    return page, width, height + 60


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", default="runs/minilm-cpu", type=Path)
    parser.add_argument("--chart", choices=CHARTS, help="only this chart, alone on its page")
    args = parser.parse_args()
    if args.chart:
        page, width, height = chart_page(args.run, args.chart)
        print(screenshot(page, args.run / f"report-{args.chart}.png", width=width, height=height))
    else:
        print(screenshot(args.run / "report.html", args.run / "report.png"))
