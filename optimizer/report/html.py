"""report.html: one self-contained file (inline SVG and CSS, no scripts, nothing fetched) per run.

Charts, per scenario: a waterfall of where the latency went pass by pass, latency distributions per stage
(box plots of the timed calls), and the op-type time breakdown per stage (ONNX Runtime's profiler); then
accuracy per stage (digits of agreement with stage 0, against the budget), the stage table and the findings.

The waterfall uses attributed latencies: stage 0's P50 divided by each stage's chained speedup, so every bar
is the product of interleaved ratios and the bars of one chart are consistent with each other.
"""

from __future__ import annotations

import html
import math
import re
from typing import Any

import numpy as np

from optimizer.core.metrics import StageMetrics
from optimizer.core.stage import StageReport
from optimizer.report.explain import explanations
from optimizer.report.schema import RunReport
from optimizer.report.tables import columns, scenario_title, stage_rows

GREEN, RED, GREY, BLUE = "#2e9d58", "#d1495b", "#9aa5b1", "#3d7ec9"
PALETTE = ["#3d7ec9", "#e08e0b", "#2e9d58", "#d1495b", "#8e5cc9", "#5cb6c9", "#c95c9f", "#9aa5b1", "#6b8e23"]


def _esc(x: Any) -> str:
    return html.escape(str(x))


def _svg(width: int, height: int, body: list[str], title: str, kind: str) -> str:
    return (
        f'<figure><figcaption>{_esc(title)}</figcaption><svg class="chart {kind}" xmlns="http://www.w3.org/2000/svg" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">{"".join(body)}</svg></figure>'
    )


def _measured(report: RunReport) -> list[tuple[StageReport, StageMetrics]]:
    """(stage, its metrics) for the stages that ran and were measured."""
    return [(s, m) for s in report.stages if s.ok and (m := s.metrics) is not None]


def waterfall(report: RunReport, scen: str) -> str:
    stages = [s for s, _ in _measured(report) if scen in s.vs_source]
    if not stages:
        return ""
    first = stages[0].scenario(scen)
    assert first is not None  # a chained speedup in a scenario comes from its measurement there
    base = first.latency.p50_ms
    attributed = {s.name: base / s.vs_source[scen] for s in stages}
    top = max(attributed.values()) * 1.1
    row, left, width = 26, 170, 520
    body = []
    for i, st in enumerate(stages):
        y = 10 + i * row
        own = attributed[st.name]
        parent = attributed.get(st.parent or "", own)
        lo, hi = sorted((own, parent))
        x0, x1 = left + lo / top * width, left + hi / top * width
        sm = st.scenario(scen)
        vs = sm.vs_parent if sm is not None else None
        color = (
            BLUE
            if st.index == 0
            else GREY
            if vs is not None and vs.verdict == "within noise"
            else GREEN
            if own < parent
            else RED
        )
        if st.index == 0:
            x0 = left
        body.append(f'<text x="{left - 6}" y="{y + 15}" text-anchor="end" font-size="12">{_esc(st.name)}</text>')
        body.append(
            f'<rect class="bar" x="{x0:.1f}" y="{y + 3}" width="{max(x1 - x0, 1.5):.1f}" height="16" '
            f'fill="{color}"><title>{_esc(st.name)}: {own:.2f} ms</title></rect>'
        )
        delta = own - parent
        label = f"{own:.2f} ms" if st.index == 0 else f"{own:.2f} ms ({delta:+.2f})"
        body.append(f'<text x="{x1 + 6:.1f}" y="{y + 15}" font-size="11">{label}</text>')
    height = 20 + len(stages) * row
    return _svg(
        left + width + 130,
        height,
        body,
        f"Where the latency went, {scen} (attributed P50; green: the pass "
        f"saved time, red: it cost time, grey: within noise)",
        "waterfall",
    )


def boxplots(report: RunReport, scen: str) -> str:
    timed = [(s.name, sm.samples_ms) for s, m in _measured(report) if (sm := m.scenarios.get(scen)) and sm.samples_ms]
    if not timed:
        return ""
    stats = []
    for name, xs in timed:
        q = [float(v) for v in np.percentile(xs, [0, 25, 50, 75, 99])]  # as measure.stats.latency_stats computes them
        stats.append((name, q))
    top = max(q[4] for _, q in stats) * 1.08
    row, left, width = 26, 170, 520
    body = []
    for i, (name, (lo, q1, med, q3, p99)) in enumerate(stats):
        y = 10 + i * row + 12
        sx = [left + v / top * width for v in (lo, q1, med, q3, p99)]
        body.append(f'<text x="{left - 6}" y="{y + 4}" text-anchor="end" font-size="12">{_esc(name)}</text>')
        body.append(f'<line x1="{sx[0]:.1f}" x2="{sx[4]:.1f}" y1="{y}" y2="{y}" stroke="#555"/>')
        body.append(
            f'<rect class="box" x="{sx[1]:.1f}" y="{y - 7}" width="{max(sx[3] - sx[1], 1):.1f}" height="14" '
            f'fill="#cfe0f5" stroke="#3d7ec9"><title>{_esc(name)}: P50 {med:.2f} ms, P99 {p99:.2f} ms'
            f"</title></rect>"
        )
        body.append(
            f'<line x1="{sx[2]:.1f}" x2="{sx[2]:.1f}" y1="{y - 7}" y2="{y + 7}" stroke="#123" stroke-width="2"/>'
        )
        body.append(f'<text x="{sx[4] + 6:.1f}" y="{y + 4}" font-size="11">P50 {med:.2f} / P99 {p99:.2f} ms</text>')
    return _svg(
        left + width + 160,
        20 + len(stats) * row,
        body,
        f"Latency distribution per stage, {scen} (min, quartiles, P99 of every timed call)",
        "distribution",
    )


def op_breakdown(report: RunReport) -> str:
    stages = [(s.name, m.op_time_ms) for s, m in _measured(report) if m.op_time_ms]
    if not stages:
        return ""
    totals: dict[str, float] = {}
    for _, times in stages:
        for op, t in times.items():
            totals[op] = totals.get(op, 0.0) + t
    ops = [op for op, _ in sorted(totals.items(), key=lambda kv: -kv[1])][: len(PALETTE) - 1]
    color = {op: PALETTE[i] for i, op in enumerate(ops)}
    top = max(sum(times.values()) for _, times in stages) * 1.05
    row, left, width = 26, 170, 520
    body = []
    for i, (name, times) in enumerate(stages):
        y = 10 + i * row
        x = float(left)
        body.append(f'<text x="{left - 6}" y="{y + 15}" text-anchor="end" font-size="12">{_esc(name)}</text>')
        other = sum(t for op, t in times.items() if op not in color)
        for op, t in [*((op, times.get(op, 0.0)) for op in ops), ("other", other)]:
            w = t / top * width
            if w <= 0:
                continue
            body.append(
                f'<rect class="seg" x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="16" '
                f'fill="{color.get(op, PALETTE[-1])}"><title>{_esc(op)}: {t:.2f} ms</title></rect>'
            )
            x += w
        body.append(f'<text x="{x + 6:.1f}" y="{y + 15}" font-size="11">{sum(times.values()):.2f} ms</text>')
    legend_y = 20 + len(stages) * row
    for i, op in enumerate([*ops, "other"]):
        lx = left + (i % 4) * 160
        ly = legend_y + (i // 4) * 16
        body.append(
            f'<rect x="{lx}" y="{ly}" width="10" height="10" fill="{color.get(op, PALETTE[-1])}"/>'
            f'<text x="{lx + 14}" y="{ly + 9}" font-size="11">{_esc(op)}</text>'
        )
    height = legend_y + 16 * ((len(ops) + 1) // 4 + 1) + 10
    scen = report.scenarios[0].name
    generation = report.recipe.workload == "generation"
    torch = any(m.op_time_source == "torch" for _, m in _measured(report) if m.op_time_ms)
    tool = "ONNX Runtime profiler, kernel time" + ("; PyTorch profiler, aten ops, for PyTorch stages" if torch else "")
    return _svg(
        left + width + 120,
        height,
        body,
        f"Time per op type and {'decode step' if generation else 'run'}, {scen} ({tool})",
        "ops",
    )


HEADLINE_CHARS = 105


def op_delta_chart(report: RunReport, top: int = 6) -> str:
    """A diverging bar chart per stage: the op types whose time changed most against the parent (profiler kernel
    time; left, green: time the stage saved; right, red: time it added), with the summary line above."""
    found = explanations(report)
    if not found:
        return ""
    left, half, row = 230, 230, 18
    scales: dict[tuple[str, bool], float] = {}  # one scale per part (a prefill's ms are not a decode step's)
    for e in found:  # and apart across two runtimes, whose every op reads as new or gone
        key = (e.per, e.comparable)
        scales[key] = max(scales.get(key, 0.0), *(abs(r.delta_ms) for r in e.rows[:top]))
    body, y = [], 8
    for e in found:
        scale = scales[(e.per, e.comparable)] or 1.0
        head = e.headline()  # about 105 bold characters fit the chart's width; the whole line on hover
        shown = head if len(head) <= HEADLINE_CHARS else head[: HEADLINE_CHARS - 1] + "…"
        body.append(f'<text x="6" y="{y + 13}" font-size="12" font-weight="bold"><title>{_esc(head)}</title>'
                    f"{_esc(shown)}</text>")
        body.append(f'<text x="6" y="{y + 28}" font-size="11" fill="#555">{_esc(e.coverage())}</text>')
        y += 36
        if e.nodes is not None:  # ONNX Runtime's nodes the pass created or removed, by name; whole on hover
            line = e.nodes.line(2)
            cut = line if len(line) <= 125 else line[:124] + "…"
            body.append(
                f'<text x="6" y="{y + 6}" font-size="11" fill="#555"><title>{_esc(e.nodes.line(8))}</title>'
                f"{_esc(cut)}</text>"
            )
            y += 14
        zero = left + half
        body.append(f'<line x1="{zero}" y1="{y}" x2="{zero}" y2="{y + row * min(top, len(e.rows))}" stroke="#555"/>')
        for r in e.rows[:top]:
            w = abs(r.delta_ms) / scale * half
            x = zero - w if r.delta_ms < 0 else zero
            mark = f" ({e.mark(r)})" if e.mark(r) else ""  # new/gone; across two runtimes, whose op it is
            room = 36 - len(mark)  # characters that fit left of the axis
            label = (r.op if len(r.op) <= room else r.op[: room - 1] + "…") + mark
            body.append(
                f'<text x="{left - 6}" y="{y + 13}" text-anchor="end" font-size="11">{_esc(label)}</text>'
                f'<rect class="delta" x="{x:.1f}" y="{y + 3}" width="{max(w, 0.5):.1f}" height="12" '
                f'fill="{GREEN if r.delta_ms < 0 else RED}"><title>{_esc(r.op)}: {r.parent_ms:.3f} -> '
                f"{r.stage_ms:.3f} ms</title></rect>"
                f'<text x="{zero + half + 8}" y="{y + 13}" font-size="11">{r.delta_ms:+.3f} ms</text>'
            )
            y += row
        y += 10
    return _svg(
        left + 2 * half + 90,
        y,
        body,
        "Why each stage's speed changed: time per op type against its parent (each runtime's own profiler; CUDA "
        "kernels by name where traced; generation: the prefill and one decode step)",
        "opdelta",
    )


def accuracy_chart(report: RunReport) -> str:
    stages = [(s.name, m) for s, m in _measured(report) if m.accuracy]
    if not stages:
        return ""
    budget = report.settings.accuracy
    row, left, width, cap = 26, 170, 420, 12.0

    def digits(cos: float) -> float:
        return min(cap, -math.log10(max(1.0 - cos, 10**-cap)))

    body = []
    for i, (name, m) in enumerate(stages):
        y = 10 + i * row
        cos = next(iter(m.accuracy.values())).cosine
        d = digits(cos)
        fill = GREEN if m.within_budget else RED
        body.append(f'<text x="{left - 6}" y="{y + 15}" text-anchor="end" font-size="12">{_esc(name)}</text>')
        body.append(
            f'<rect class="bar" x="{left}" y="{y + 3}" width="{max(d / cap * width, 1):.1f}" height="16" '
            f'fill="{fill}"><title>cosine {cos:.9f}</title></rect>'
        )
        body.append(f'<text x="{left + d / cap * width + 6:.1f}" y="{y + 15}" font-size="11">cosine {cos:.6f}</text>')
    metric = report.settings.accuracy_metric or budget.get("metric") or "cosine"
    if metric == "cosine" and budget.get("min") is not None:
        bx = left + digits(budget["min"]) / cap * width
        body.append(
            f'<line x1="{bx:.1f}" x2="{bx:.1f}" y1="5" y2="{15 + len(stages) * row}" stroke="#000" '
            f'stroke-dasharray="4 3"/><text x="{bx + 4:.1f}" y="{20 + len(stages) * row}" font-size="11">'
            f"budget {budget['min']}</text>"
        )
    return _svg(
        left + width + 150,
        30 + len(stages) * row,
        body,
        "Accuracy against stage 0 (bar length: digits of agreement, -log10(1 - cosine))",
        "accuracy",
    )


def sweep_chart(report: RunReport) -> str:
    """Throughput bars per batch size, each labelled with its P99; the recommended batches marked."""
    sweep = report.batch_sweep
    if sweep is None or not sweep.rows:
        return ""
    rows = sweep.rows
    top = max(r.samples_per_s for r in rows) * 1.1
    row, left, width = 26, 90, 480
    budget = sweep.latency_budget_ms if sweep.latency_budget_ms is not None else float("inf")
    body = []
    for i, r in enumerate(rows):
        y = 10 + i * row
        w = r.samples_per_s / top * width
        within = r.p99_ms <= budget
        mark = " max" if r.batch == sweep.max_batch else ""
        mark += " preferred" if r.batch == sweep.preferred_batch else ""
        body.append(f'<text x="{left - 6}" y="{y + 15}" text-anchor="end" font-size="12">batch {r.batch}</text>')
        body.append(
            f'<rect class="bar" x="{left}" y="{y + 3}" width="{max(w, 1):.1f}" height="16" '
            f'fill="{GREEN if within else RED}"><title>{r.samples_per_s:.1f} samples/s</title></rect>'
        )
        body.append(
            f'<text x="{left + w + 6:.1f}" y="{y + 15}" font-size="11">{r.samples_per_s:.1f}/s, '
            f"P99 {r.p99_ms:.1f} ms{mark}</text>"
        )
    title = (
        f"Batch sweep of {sweep.stage}: throughput per batch (green: P99 within "
        f"{sweep.latency_budget_ms} ms). {sweep.why}"
    )
    return _svg(left + width + 220, 20 + len(rows) * row, body, title, "sweep")


def _table(report: RunReport, scen: str) -> str:
    cols = columns(report)
    head = "".join(f"<th>{_esc(h)}</th>" for _, h in cols)
    rows = "".join(
        "<tr>" + "".join(f"<td>{_esc(r[k])}</td>" for k, _ in cols) + "</tr>" for r in stage_rows(report, scen)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


CSS = """body{font-family:DejaVu Sans,Arial,sans-serif;margin:24px;color:#1d2733;max-width:1100px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}figure{margin:12px 0}
figcaption{font-size:13px;color:#444;margin-bottom:4px}table{border-collapse:collapse;font-size:12px}
td,th{border:1px solid #ddd;padding:3px 6px;text-align:right}td:first-child,th:first-child{text-align:left}
.findings li{color:#9b2c2c}.meta{font-size:12px;color:#555}"""


def _code(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", _esc(text))  # the sentences are written for markdown


def scenario_best_table(report: RunReport) -> str:
    """Each scenario's fastest stage within the budget (stage 0 included) and the advice when they differ."""
    best = report.best
    if best is None or not best.per_scenario:
        return ""
    rows = "".join(
        f"<tr><td>{_esc(scen)}</td><td><code>{_esc(w.stage)}</code>{' (keep stage 0)' if w.keep_source else ''}"
        f"</td><td>{w.ratio:.2f}x ({w.low:.2f}-{w.high:.2f})</td></tr>"
        for scen, w in best.per_scenario.items()
    )
    advice = f"<p><b>Per scenario</b>: {_code(best.advice)}.</p>" if best.advice else ""
    return ("<table><tr><th>scenario</th><th>fastest within budget</th><th>vs stage 0 (95% CI)</th></tr>"
            f"{rows}</table>{advice}")


def to_html(report: RunReport) -> str:
    r = report
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{_esc(r.recipe.name)}</title>"
        f"<style>{CSS}</style></head><body>",
        f"<h1>{_esc(r.recipe.name)}: {_esc(r.outcome)}</h1>",
        f"<p class='meta'>{_esc(r.created)} &middot; {_esc(r.settings.device)}, "
        f"{r.settings.threads} threads, {_esc(r.environment.cpu)} &middot; "
        f"{_esc(', '.join(f'{k} {v}' for k, v in r.environment.packages.items()))}</p>",
    ]
    if r.best is not None and r.best.stage:
        why = re.sub(r"`([^`]+)`", r"<code>\1</code>", _esc(r.best.why))  # the sentence is written for markdown
        parts.append(f"<p><b>Best stage</b>: {why}.</p>")
        parts.append(scenario_best_table(r))
    if r.findings:
        parts.append(
            "<h2>Findings</h2><ul class='findings'>" + "".join(f"<li>{_esc(f)}</li>" for f in r.findings) + "</ul>"
        )
    for scen in r.scenarios:
        name = scen.name
        parts.append(f"<h2>Scenario {_esc(scenario_title(r, scen))}</h2>")
        parts += [waterfall(r, name), boxplots(r, name), _table(r, name)]
    if r.batch_sweep is not None and r.batch_sweep.rows:
        parts += ["<h2>Batch sweep</h2>", sweep_chart(r)]
    ops, deltas = op_breakdown(r), op_delta_chart(r)
    parts += [
        "<h2>Where the time goes inside each stage</h2>" if ops else "",
        ops,
        "<h2>Why each stage's speed changed</h2>" if deltas else "",
        deltas,
        "<h2>Accuracy</h2>",
        accuracy_chart(r),
        "</body></html>",
    ]
    return "\n".join(p for p in parts if p)
