"""The stage tables as strings, one row per stage: shared by report.md, report.html and the terminal."""

from __future__ import annotations

import math
from dataclasses import dataclass

from optimizer.core.metrics import CudaKernels, Latency, OutputAccuracy, ScenarioMetrics, Speedup
from optimizer.core.stage import StageReport
from optimizer.report.schema import RunReport, ScenarioEcho

COLUMNS = [
    ("stage", "stage"),
    ("parent", "parent"),
    ("status", "status"),
    ("p50", "P50 ms"),
    ("p99", "P99 ms"),
    ("throughput", "samples/s"),
    ("vs_parent", "vs parent"),
    ("vs_source", "vs stage 0"),
    ("cosine", "cosine"),
    ("budget", "budget"),
    ("size_mb", "size MB"),
    ("memory_mb", "mem MB"),
]

GENERATION_COLUMNS = [
    ("stage", "stage"),
    ("parent", "parent"),
    ("status", "status"),
    ("ttft", "TTFT P50 ms"),
    ("tpot_p50", "TPOT P50 ms"),
    ("tpot_p99", "TPOT P99 ms"),
    ("tpot_vs_export", "TPOT vs export"),
    ("tokens_per_s", "tokens/s"),
    ("p50", "task P50 ms"),
    ("vs_parent", "vs parent"),
    ("vs_source", "vs stage 0"),
    ("agreement", "token agree"),
    ("cosine", "logits cos"),
    ("budget", "budget"),
    ("size_mb", "size MB"),
]
TABLE_METRICS = ("cosine", "pooled_cosine", "top1")  # budget metrics the accuracy column can show


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def size_mb_cell(size_bytes: int | None) -> str:
    """MB with one decimal; under 1 MB three significant digits, so two small graphs do not both read 0.0."""
    if size_bytes is None:
        return "-"
    mb = size_bytes / 2**20
    return f"{mb:.1f}" if mb >= 1 else f"{mb:.3g}"


def kernels_cell(k: CudaKernels | None) -> str:
    """'412/3': kernels run on the device / launch calls the host made for them (a CUDA graph replay is one)."""
    return "-" if k is None or not k.counted else f"{k.kernels:.0f}/{k.launches:.0f}"


def gpu_time_cell(sm: ScenarioMetrics | None) -> str:
    """'0.84/0.61': the CUDA event span P50 (kernels and the gaps between their launches) / the GPU's busy time
    per call (while a kernel ran, from CUPTI); host latency is the P50 column. Each '-' where not measured."""
    if sm is None:
        return "-"
    span = fmt(sm.gpu_latency.p50_ms if sm.gpu_latency is not None else None)
    busy = sm.cuda_kernels.busy_ms if sm.cuda_kernels is not None else None
    return f"{span}/{fmt(busy)}"


def tail_cell(lat: Latency | None, key: str = "p99") -> str:
    """A tail percentile when its 95% interval is bounded by the calls taken, else 'n.r.' (not resolved)."""
    if lat is None:
        return "-"
    if not lat.resolved(key):
        return "n.r."
    return fmt(getattr(lat, f"{key}_ms"))


def speed_cell(vs: Speedup | None) -> str:
    """'1.32x' when beyond noise, '~1.01x' when within it."""
    if vs is None:
        return "-"
    mark = "~" if vs.verdict == "within noise" else ""
    return f"{mark}{vs.ratio:.2f}x"


def status_cell(stage: StageReport, short: bool = False) -> str:
    if short or not stage.reason:
        return stage.status
    return f"{stage.status}: {stage.reason}"


def input_shape(report: RunReport, batch: int, seq: int, dims: dict[str, int] | None = None) -> str:
    """What the model takes at these bindings, past the batch: 'seq 128' when an input has a sequence (or the
    recipe names no inputs), else each input's shape: '3x224x224' for an image model's one input, or
    'pixel_values 3x224x224, scale 1' for several."""
    inputs = [x for x in (report.recipe.model_extra or {}).get("inputs") or [] if isinstance(x, dict)]
    if not inputs or any("seq" in (x.get("shape") or []) for x in inputs):
        return f"seq {seq}"
    bound: dict[str, int] = {"batch": batch, "seq": seq, **(dims or {})}
    shapes = []
    for x in inputs:
        shape = list(x.get("shape") or [])
        if shape[:1] == ["batch"]:
            shape = shape[1:]
        shapes.append((str(x.get("name", "?")), "x".join(str(bound.get(d, d)) for d in shape) or "one value"))
    return shapes[0][1] if len(shapes) == 1 else ", ".join(f"{name} {shape}" for name, shape in shapes)


def scenario_title(report: RunReport, scen: ScenarioEcho) -> str:
    """'b1-natural (batch 1, natural lengths 9-61 tokens, median 21, 32 inputs)', '(batch 1, seq 128)', or for
    inputs without a sequence their shape: '(batch 1, 3x224x224)'."""
    inputs = next(
        (sm.inputs for st in report.stages if (sm := st.scenario(scen.name)) is not None and sm.inputs is not None),
        None,
    )
    if inputs is not None and inputs.padding == "longest":
        shape = (
            f"natural lengths {inputs.seq_min}-{inputs.seq_max} tokens, median {inputs.seq_median:g}, "
            f"{inputs.samples} inputs timed in turn"
        )
    else:
        timed = f", {inputs.samples} inputs timed in turn" if inputs is not None and inputs.samples else ""
        shape = f"{input_shape(report, scen.batch, scen.seq, scen.dims)}{timed}"
    return f"{scen.name} (batch {scen.batch}, {shape})"


def tail_note(report: RunReport) -> str | None:
    """The footnote for tables with an unresolved P99."""
    from optimizer.measure.stats import calls_to_resolve

    unresolved = [
        sm.latency.n
        for st in report.stages
        if st.metrics is not None
        for sm in st.metrics.scenarios.values()
        if not sm.latency.resolved("p99")
    ]
    if not unresolved:
        return None
    lo, hi = min(unresolved), max(unresolved)
    calls = f"{lo}" if lo == hi else f"{lo}-{hi}"
    return (
        f"P99 n.r.: not resolved. {calls} calls cannot bound a P99 (its 95% interval "
        f"needs at least {calls_to_resolve(0.99)}); set `benchmark: {{resolve_tail: true}}` to take enough."
    )


def _accuracy_cell(first: OutputAccuracy | None, metric: str) -> str:
    if first is None:
        return "-"
    value = first.figure(metric)
    return f"{value if value is not None else first.cosine:.6f}"


def stage_rows(report: RunReport, scenario: str) -> list[dict[str, str]]:
    """One row per stage for one scenario, as strings; shared by the terminal table and report.md. The accuracy
    column shows the figure the budget judges (its metric), so the column and the verdict beside it agree."""
    metric = report.settings.accuracy_metric or "cosine"
    if metric not in TABLE_METRICS:
        metric = "cosine"
    rows = []
    for st in report.stages:
        m = st.metrics
        sm = st.scenario(scenario)
        lat = sm.latency if sm is not None else None
        first = m.first_accuracy if m is not None else None
        size = m.size_bytes if m is not None else None
        vs0 = st.vs_source.get(scenario)
        rows.append(
            {
                "stage": f"{st.index:02d} {st.name}",
                "parent": st.parent or "-",
                "status": status_cell(st, short=True),
                "p50": fmt(lat.p50_ms if lat is not None else None),
                "p99": tail_cell(lat),
                "throughput": fmt(sm.throughput.samples_per_s if sm is not None else None, ".1f"),
                "vs_parent": speed_cell(sm.vs_parent if sm is not None else None),
                "vs_source": "-" if vs0 is None else f"{vs0:.2f}x",
                "cosine": _accuracy_cell(first, metric),
                "budget": "-" if m is None else ("ok" if m.within_budget else "REJECTED") + (" (edge)" if m.budget_edge
                                                                                         else ""),
                "size_mb": size_mb_cell(size),
                "memory_mb": fmt(m.memory_mb if m is not None else None, ".0f"),
                "ttft": fmt(sm.ttft.p50_ms if sm is not None and sm.ttft is not None else None),
                "tpot_p50": fmt(sm.tpot.p50_ms if sm is not None and sm.tpot is not None else None),
                "tpot_p99": tail_cell(sm.tpot if sm is not None else None),
                "tokens_per_s": fmt(sm.throughput.tokens_per_s if sm is not None else None, ".1f"),
                "agreement": "-" if first is None or first.token_agreement is None else f"{first.token_agreement:.3f}",
                "cv": "-" if lat is None else f"{lat.cv:.1%}",
                "kernels": kernels_cell(sm.cuda_kernels if sm is not None else None),
                "gpu_time": gpu_time_cell(sm),
                "tpot_vs_export": _tpot_cell(report, st, scenario),
            }
        )
    return rows


def _tpot_cell(report: RunReport, st: StageReport, scenario: str) -> str:
    if report.recipe.workload != "generation":
        return "-"
    t = tpot_vs_export(report, st, scenario)
    return "-" if t is None else t.cell()


def columns(report: RunReport) -> list[tuple[str, str]]:
    """The table's columns: generation runs show TTFT/TPOT/tokens/s instead of one-shot latency; CUDA runs add
    kernels run / host launches per call."""
    cols = GENERATION_COLUMNS if report.recipe.workload == "generation" else COLUMNS
    metric = report.settings.accuracy_metric
    if metric in ("pooled_cosine", "top1"):
        cols = [(k, metric if k == "cosine" else h) for k, h in cols]
    counted = any(
        sm.cuda_kernels is not None
        for st in report.stages
        if st.metrics is not None
        for sm in st.metrics.scenarios.values()
    )
    return [*cols, ("gpu_time", "span/busy ms"), ("kernels", "kernels/launches")] if counted else cols


def scenario_summary(report: RunReport) -> tuple[list[str], list[list[str]]]:
    """Stage x scenario: speedup vs stage 0 (P50) in each cell, because a pass can help one scenario and hurt
    another. The speedup (chained interleaved ratios) leads: P50s of stages measured in different sessions
    carry the drift between those sessions, the ratios do not."""
    names = report.scenario_names
    rows = []
    for st in report.stages:
        cells = [f"{st.index:02d} {st.name}"]
        for n in names:
            sm = st.scenario(n)
            if sm is not None:
                vs0 = st.vs_source.get(n)
                p50 = f"{sm.latency.p50_ms:.2f} ms"
                cells.append(f"{vs0:.2f}x ({p50})" if vs0 else p50)
            else:
                cells.append(st.status)
        rows.append(cells)
    return ["stage", *names], rows


# ------------------------------------------------------------------ generation: TPOT against the FP32 export
EXPORT_STAGE = "export"
Z95 = 1.96


@dataclass(frozen=True)
class TpotRatio:
    """Export TPOT P50 / the stage's (> 1: the stage decodes faster), the product of the interleaved TPOT ratios
    along the path from the export; low/high: the product of each link's interval ends."""

    ratio: float
    low: float
    high: float
    path: list[str]  # the export, ..., the stage
    approximate: bool  # some link's interval came from the TPOT spread, not a bootstrap over rounds

    @property
    def chained(self) -> bool:
        return len(self.path) > 2

    def cell(self) -> str:
        if len(self.path) == 1:
            return "1.00x (export)"
        return f"{self.ratio:.2f}x{' chained' if self.chained else ''} ({self.low:.2f}-{self.high:.2f})"


def export_stage(report: RunReport) -> StageReport | None:
    """The FP32 export generation stages are compared against: the stage named `export`, else the first ONNX one."""
    named = report.stage(EXPORT_STAGE)
    if named is not None and named.ok:
        return named
    return next((s for s in report.stages if s.ok and s.artifact is not None and s.artifact.kind == "onnx"), None)


def _tpot_link(sm: ScenarioMetrics) -> tuple[float, float, float, bool] | None:
    """(ratio, low, high, approximate) of parent TPOT P50 / stage TPOT P50 from the same interleaved session: the
    recorded bootstrap interval when measure kept one, else a normal interval of the two medians whose standard
    error counts one sample per generation (decode steps of one generation are not independent)."""
    if sm.tpot_vs_parent is not None:
        vs = sm.tpot_vs_parent
        return vs.ratio, vs.low, vs.high, False
    mine, theirs = sm.tpot, sm.parent_tpot
    if mine is None or theirs is None or mine.p50_ms <= 0 or theirs.p50_ms <= 0:
        return None
    n = max(sm.iterations or min(mine.n, theirs.n), 1)
    rel = math.sqrt(sum((1.2533 * lat.std_ms / math.sqrt(n) / lat.p50_ms) ** 2 for lat in (mine, theirs)))
    ratio = theirs.p50_ms / mine.p50_ms
    return ratio, ratio * math.exp(-Z95 * rel), ratio * math.exp(Z95 * rel), True


def tpot_vs_export(report: RunReport, st: StageReport, scenario: str) -> TpotRatio | None:
    """The stage's TPOT ratio against the export on one scenario, chained along its ancestry; None off that path
    (stage 0, a stage that does not descend from the export) or where a link was not measured."""
    export = export_stage(report)
    if export is None or not st.ok:
        return None
    by_name = {s.name: s for s in report.stages}
    ratio = low = high = 1.0
    approximate = False
    path, here = [st.name], st
    while here.name != export.name:
        sm = here.scenario(scenario)
        link = _tpot_link(sm) if sm is not None else None
        parent = by_name.get(here.parent or "")
        if link is None or parent is None:
            return None
        ratio, low, high = ratio * link[0], low * link[1], high * link[2]
        approximate = approximate or link[3]
        here = by_name.get(parent.measured_against or parent.name, parent)  # a skipped parent: what it passed on
        path.append(here.name)
    return TpotRatio(ratio, low, high, path[::-1], approximate)


def tpot_lines(report: RunReport) -> list[str]:
    """report.md's section for generation runs: each stage's TPOT against the FP32 export, with its agreement."""
    export = export_stage(report)
    if report.recipe.workload != "generation" or export is None:
        return []
    lines = []
    for scen in report.scenario_names:
        for st in report.stages:
            t = tpot_vs_export(report, st, scen)
            if t is None or len(t.path) == 1:
                continue
            first = st.metrics.first_accuracy if st.metrics is not None else None
            agree = first.token_agreement if first is not None else None
            how = f"chained over {' -> '.join(t.path)}" if t.chained else "interleaved with it"
            word = "faster" if t.low > 1 else "slower" if t.high < 1 else "within noise"
            lines.append(
                f"- {st.name} on {scen}: TPOT {t.ratio:.2f}x against {export.name} ({word}, 95% interval "
                f"{t.low:.2f}-{t.high:.2f}{', approximate' if t.approximate else ''}, {how}); token agreement "
                f"{fmt(agree, '.3f')}"
            )
    if not lines:
        return []
    return [
        f"## Decode speed against the FP32 export (`{export.name}`)",
        "",
        "TPOT ratio: export TPOT P50 / the stage's (> 1: faster), each link timed interleaved with its input; "
        "along a chain the ratios and their interval ends are multiplied. Token agreement: against stage 0's "
        "greedy tokens.",
        "",
        *lines,
        "",
    ]
