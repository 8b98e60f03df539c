"""report.md: the typed run report rendered as markdown (header and legend, a stage table per scenario, the best
stage and per-scenario winners, the batch sweep, findings, explanations, a section per stage); reads the report
alone and writes nothing."""

from __future__ import annotations

from optimizer.core.markup import md_inline
from optimizer.core.metrics import StageMetrics
from optimizer.measure.denormal_probe import PENALTY_FLOOR
from optimizer.report.explain import markdown as explain_markdown
from optimizer.report.schema import RunReport
from optimizer.report.tables import (
    columns,
    fmt,
    input_shape,
    scenario_summary,
    scenario_title,
    stage_rows,
    status_cell,
    tail_note,
    tpot_lines,
)


def instance_line(report: RunReport) -> list[str]:
    """The legend's line on the spread between sessions of one artifact, when the stages measured it."""
    spreads = [
        (vs.instance_sd, scen, st.name)
        for st in report.stages
        if st.metrics is not None
        for scen, m in st.metrics.scenarios.items()
        if (vs := m.vs_parent) is not None and vs.instance_sd is not None
    ]
    if not spreads:
        return []
    sd, scen, name = max(spreads)
    n = report.settings.benchmark.get("instances")
    if sd < 0.0005:
        return [f"- each side of a ratio ran {n} sessions of its artifact in turn: no spread between sessions of one "
                "artifact showed beyond the round noise, so the intervals are the in-run ones."]
    return [
        f"- each side of a ratio ran {n} sessions of its artifact in turn: sessions of one artifact differed in "
        f"speed by up to {sd:.1%} (sd, pooled over the stages; on {scen}, e.g. `{name}`), and the intervals include "
        "that spread."
    ]


def denormal_line(report: RunReport) -> list[str]:
    """The legend's line on what denormal floats cost this CPU (measured at the run's start)."""
    cal = report.machine.calibration if report.machine is not None else None
    penalty = cal.denormal_penalty if cal is not None else None
    if penalty is None:
        return []
    what = ("it handles them in hardware, so flushing them to zero gains nothing here" if penalty < PENALTY_FLOOR
            else "padded inputs pay for it; stages are probed (findings) and `denormal_as_zero` flushes them")
    return [f"- denormal floats: this CPU multiplies them {penalty:.1f}x as slowly as normal ones; {what}."]


def disk_line(r: RunReport) -> list[str]:
    """The run's disk, stage by stage: each measured stage's own bytes (hard-linked weights count once)."""
    own = [(s.name, s.metrics.own_bytes) for s in r.stages if s.metrics and s.metrics.own_bytes is not None]
    if not own:
        return []
    total = sum(b for _, b in own)
    big = ", ".join(f"{md_inline(n)} {b / 2**20:.0f} MiB" for n, b in own if b >= 2**20)
    return [f"- disk: {total / 2**20:.0f} MiB written by the measured stages{': ' + big if big else ''} "
            "(a stage that links its input's weights adds only its graph)"]


def to_markdown(report: RunReport) -> str:
    r = report
    lines = [
        f"# {r.recipe.name}: optimizer run",
        "",
        f"- outcome: **{r.outcome}**, wall time {r.wall_seconds:.0f} s",
        f"- device: {r.settings.device}, threads: {r.settings.threads}, cpu: {r.environment.cpu}",
        f"- packages: {', '.join(f'{k} {v}' for k, v in r.environment.packages.items())}",
        f"- benchmark: {r.settings.benchmark}",
        "- `~1.01x`: within noise (the confidence interval of the interleaved ratio includes 1.0).",
        *instance_line(r),
        *denormal_line(r),
        *disk_line(r),
        "",
    ]
    for scen in r.scenarios:
        lines += [f"## Scenario {scenario_title(r, scen)}", ""]
        cols = columns(r)
        lines.append("| " + " | ".join(h for _, h in cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for row in stage_rows(r, scen.name):
            lines.append("| " + " | ".join(md_inline(row[k]) for k, _ in cols) + " |")
        lines.append("")
    note = tail_note(r)
    if note:
        lines += [note, ""]
    lines += tpot_lines(r)
    if r.best is not None:
        lines += [f"**Best stage**: {md_inline(r.best.why)}.", ""]
        lines += scenario_best_markdown(r)
    if len(r.scenarios) > 1:
        head, rows = scenario_summary(r)
        lines += (
            [
                "## Scenario x stage (speedup vs stage 0, then P50 in the stage's own session)",
                "",
                "| " + " | ".join(head) + " |",
                "|" + "---|" * len(head),
            ]
            + ["| " + " | ".join(md_inline(c) for c in row) + " |" for row in rows]
            + [""]
        )
    sweep = r.batch_sweep
    if sweep is not None and sweep.rows:
        lines += [
            f"## Batch sweep of `{sweep.stage}` ({_sweep_shape(r)})",
            "",
            "| batch | P50 ms | P99 ms | samples/s | memory growth MB |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {x.batch} | {x.p50_ms:.2f} | {x.p99_ms:.2f} | {x.samples_per_s:.1f} | {x.memory_growth_mb:.0f} |"
            for x in sweep.rows
        ]
        lines += [f"| {x.batch} | skipped: {md_inline(x.reason)} | | | |" for x in sweep.skipped or []]
        lines += ["", f"Recommendation: {md_inline(sweep.why)}", ""]
    if r.findings:
        lines += ["## Findings", ""] + [f"- {md_inline(f)}" for f in r.findings] + [""]
    lines += explain_markdown(r)
    lines += ["## Stages", ""]
    for st in r.stages:
        lines.append(f"### {st.index:02d} {st.name} ({st.type})")
        status = md_inline(status_cell(st))
        lines.append(f"- status: {status}; folder: `{st.folder or '-'}`; parent: {st.parent or '-'}")
        if st.metrics is not None:
            lines += _metrics_lines(st.metrics)
        if st.pass_seconds is not None:
            lines.append(f"- pass time: {st.pass_seconds:.1f} s; benchmark time: {fmt(st.bench_seconds, '.1f')} s")
        lines.append("")
    return "\n".join(lines)


def _sweep_shape(report: RunReport) -> str:
    """The input shape the batch sweep timed: the first scenario's, at other batch sizes (engine.sweep)."""
    sweep, first = report.batch_sweep, (report.scenarios or [None])[0]
    seq = sweep.seq if sweep is not None and sweep.seq is not None else first.seq if first is not None else 0
    return input_shape(report, 1, seq, first.dims if first is not None else None)


def scenario_best_markdown(report: RunReport) -> list[str]:
    """The per-scenario winners as a table, and the deployment advice when they differ."""
    best = report.best
    if best is None or not best.per_scenario:
        return []
    lines = ["| scenario | fastest within budget | vs stage 0 (95% CI) | note |", "|---|---|---|---|"]
    for scen, w in best.per_scenario.items():
        name = f"`{w.stage}` (keep stage 0)" if w.keep_source else f"`{w.stage}`"
        # the rule's sentence past its first clause (ties, rejections), or why PyTorch is kept
        note = w.why if w.keep_source else (w.why.split("; ", 1)[1] if "; " in w.why else "-")
        lines.append(f"| {scen} | {name} | {w.ratio:.2f}x ({w.low:.2f}-{w.high:.2f}) | {md_inline(note)} |")
    lines.append("")
    if best.advice:
        lines += [f"**Per scenario**: the winners differ: {md_inline(best.advice)}. "
                  "`optimizer export RUN --stage best --scenario NAME` exports a scenario's winner.", ""]
    return lines


def _metrics_lines(m: StageMetrics) -> list[str]:
    lines = []
    if m.runtime:
        lines.append(f"- runtime: {md_inline(m.runtime)}")
    if m.graph is not None and m.graph.present:
        per = "decode step" if m.workload == "generation" else "call"
        graph = "prefill graph" if m.workload == "generation" else "graph"
        lines.append(
            f"- nodes in the {graph}: {m.graph.nodes}; executed per {per}: "
            f"{m.nodes_executed or '-'}; op types: {m.graph.op_types}"
        )
    mem = m.memory
    if mem is not None and mem.method == "process":
        lines.append(
            f"- host memory (fresh process): peak {mem.peak_mb:.0f} MB, resident after {mem.steady_mb:.0f}"
            f" MB, above {mem.runtime_mb:.0f} MB of runtime; in-process growth was {mem.inline_mb:.0f} MB"
        )
    elif mem is not None:
        lines.append(f"- host memory (in-process growth): {m.memory_mb:.0f} MB {md_inline(mem.reason or '')}".rstrip())
    if m.worker_peak_mb is not None:
        lines.append(f"- compile memory: the stage's worker peaked at {m.worker_peak_mb:.0f} MB resident (pass and "
                     "measuring)")
    if m.budget:
        verdict = "within budget" if m.within_budget else "REJECTED"
        lines.append(f"- accuracy: {md_inline(m.budget)} ({verdict}{', at the edge' if m.budget_edge else ''})")
    return lines
