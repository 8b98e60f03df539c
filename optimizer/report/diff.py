"""Diff two runs pass by pass: stages aligned by name, latency both sides, ratio, noise, accuracy change.

Two runs are never interleaved, and the machine drifts between them (other jobs, frequency, memory layout): raw
P50s of the same code moved 0.54x between two runs here. So each pass is judged by what it contributes in its own
run: its interleaved ratio against its input (the control measured beside it, in both runs). B/A of that ratio is
the pass's own change; machine drift that slows a stage and its input alike cancels.

Noise: each run's ratio has its 95% bootstrap interval, but the ratios themselves move between runs more than
those intervals say (the same fuse stage read 1.36x and 1.11x in two runs of identical code). That between-run
move is estimated from the runs themselves: a robust scale (1.4826 x the median absolute change) of the other
passes' ratio changes, leaving the judged pass out, added to its interval. A pass timed against stage 0 (PyTorch
against ONNX Runtime) also carries stage 0's own between-run change, so its interval is widened by that change
(the control's). A real slowdown of one pass stands out from the others; a machine that moved every ratio widens
all. The intervals hold for all judged rows together (Bonferroni: with eight rows each is a 99.4% interval), so
an A/A diff flags nothing 95% of the time, not 95% of its rows. Changes under MIN_EFFECT are never called.
Stage 0, the control, is shown with its raw P50 change (a bootstrap of each side's samples) and is not judged:
two runs cannot separate its own change from the machine's.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Literal

import numpy as np

from optimizer.core.metrics import ClosedFacts, ScenarioMetrics, SpeedVerdict, StageMetrics
from optimizer.core.stage import StageReport, Status
from optimizer.report.explain import between_runs
from optimizer.report.schema import RunReport
from optimizer.report.timings import require_timings

MIN_EFFECT = 0.02  # between-run differences smaller than this are within noise, whatever the intervals say
# The between-run move of a ratio is never taken below this (log): with few passes the estimate is poor, and on
# the test machine identical code moved pass ratios 5-30% between runs (benchmarks/aa_diff.py).
MIN_BETWEEN_RUNS = 0.03
Z95 = 1.96  # the in-run intervals stored in the reports are 95% each


def simultaneous_z(rows: int) -> float:
    """Normal quantile that makes `rows` two-sided 95% intervals hold together (Bonferroni): a diff judges every
    pass on every scenario, and at 95% each one A/A diff of eight rows in three would flag a change."""
    return NormalDist().inv_cdf(1 - 0.025 / max(rows, 1))


OP_ROWS = 6  # op types listed per stage in `op_changes`

DiffVerdict = Literal["faster", "slower", "within noise", "control"]  # "control": stage 0, shown and not judged


class RunSide(ClosedFacts):
    run_dir: str
    created: str
    recipe: str  # the recipe's name


class DiffRow(ClosedFacts):
    """One stage on one scenario in both runs. `between_runs` and `control_widening` are present only on rows
    judged by their own ratio, and the figures from `p50_a` on only where both runs measured the stage there."""

    scenario: str
    stage: str
    type: str
    status_a: Status
    status_b: Status
    between_runs: float | None = None  # the between-run move of a ratio (log) added to the interval
    control_widening: float | None = None  # stage 0's own between-run change (log), for passes timed against it
    p50_a: float | None = None
    p50_b: float | None = None
    raw_ratio: float | None = None  # A's P50 / B's
    ratio: float | None = None  # A/B: > 1 when B is faster
    basis: str | None = None  # what `ratio` is
    low: float | None = None
    high: float | None = None
    verdict: DiffVerdict | None = None
    vs_parent_a: float | None = None
    vs_parent_b: float | None = None
    vs_source_a: float | None = None
    vs_source_b: float | None = None
    cosine_a: float | None = None  # the accuracy figure a reader compares (_accuracy)
    cosine_b: float | None = None


class OpChange(ClosedFacts):
    """Why a stage judged faster or slower moved between the runs, on one scenario and part (report.explain)."""

    stage: str
    scenario: str
    part: str  # "call", "prefill" or "decode step"
    kind: Literal["ops", "kernels"]
    summary: str
    coverage: str
    nodes: str | None  # ORT's nodes new and gone, one line
    ops: list[tuple[str, float, float, float]]  # (op type, A ms, B ms, B - A ms), the largest changes first


class DiffSummary(ClosedFacts):
    """What `optimizer diff` prints; `--format json` writes its `to_json()`."""

    a: RunSide
    b: RunSide
    only_in_a: list[str]
    only_in_b: list[str]
    rows: list[DiffRow]
    machine_drift: float | None
    final_stage: str | None
    judged_rows: int  # the intervals hold for these together (simultaneous_z)
    totals: list[DiffRow]  # the final stage's measured rows
    op_changes: list[OpChange]


def machine_drift(a: RunReport, b: RunReport) -> float | None:
    """Change of the fixed calibration workload (measure/machine.py) from run A to run B (B/A - 1), or None."""
    means = []
    for r in (a, b):
        c = r.machine.calibration if r.machine is not None else None
        if c is None or not c.before_ms:
            return None
        means.append(math.sqrt(c.before_ms * (c.after_ms or c.before_ms)))
    return means[1] / means[0] - 1


def _link(e: ScenarioMetrics) -> tuple[float, float] | None:
    """(log ratio, log sigma) of a stage's interleaved ratio against its input."""
    vs = e.vs_parent
    if vs is None or not vs.ratio:
        return None
    # The in-run interval: the spread between sessions is part of the between-run move the diff estimates itself
    low, high = vs.in_run_low or vs.low, vs.in_run_high or vs.high
    return math.log(vs.ratio), (math.log(max(high, 1e-12)) - math.log(max(low, 1e-12))) / (2 * Z95)


def _between_runs(changes: dict[tuple[str, str], float], stage: str, direct: set[str]) -> float:
    """The typical between-run move of a ratio (log), beyond its in-run interval: a robust scale (1.4826 x the
    median absolute change) of the other passes' ratio changes, leaving the judged pass out. Passes timed
    against stage 0 are left out of the estimate when enough others remain: their ratio also carries stage 0's
    own between-run change (PyTorch against ONNX Runtime), which is added to their interval apart."""
    pool = [abs(m) for (st, _), m in changes.items() if st != stage and st not in direct]
    if len(pool) < 3:
        pool = [abs(m) for (st, _), m in changes.items() if st != stage]
    return max(1.4826 * float(np.median(pool)) if pool else 0.0, MIN_BETWEEN_RUNS)


def _verdict(
    a: ScenarioMetrics, b: ScenarioMetrics, z: float = Z95, seed: int = 0
) -> tuple[float, float, SpeedVerdict]:
    """(low, high) of the A/B ratio's interval (z: its normal quantile), and whether B is faster, slower or within
    noise."""
    sa, sb = a.samples_ms, b.samples_ms
    if sa and sb:
        rng = np.random.default_rng(seed)
        xa, xb = np.asarray(sa), np.asarray(sb)
        tail = 1 - NormalDist().cdf(z)
        n = max(1000, math.ceil(20 / tail))  # some resamples beyond a Bonferroni tail
        ra = np.median(xa[rng.integers(0, len(xa), (n, len(xa)))], axis=1)
        rb = np.median(xb[rng.integers(0, len(xb), (n, len(xb)))], axis=1)
        low, high = (float(v) for v in np.quantile(ra / rb, [tail, 1 - tail]))
    else:
        la, lb = a.latency, b.latency
        se_a = 1.2533 * la.std_ms / math.sqrt(max(la.n, 1))
        se_b = 1.2533 * lb.std_ms / math.sqrt(max(lb.n, 1))
        ratio = la.p50_ms / lb.p50_ms
        rel = math.sqrt((se_a / la.p50_ms) ** 2 + (se_b / lb.p50_ms) ** 2)
        low, high = ratio * (1 - z * rel), ratio * (1 + z * rel)
    verdict: SpeedVerdict = "faster" if low > 1.0 else "slower" if high < 1.0 else "within noise"
    return low, high, verdict


def _stages(report: RunReport) -> dict[str, StageReport]:
    return {s.name: s for s in report.stages}


def _model_label(report: RunReport) -> str:
    model = report.recipe.model
    what = model.get("path") or model.get("architecture") or model.get("target") or "?"
    return f"{report.recipe.name} ({model['source']}: {what})"


def different_models(a: RunReport, b: RunReport) -> str | None:
    """Why A and B are not two runs of one model (stage-by-stage ratios would then not be pass effects), or None."""
    if a.recipe.model == b.recipe.model:
        return None
    return f"A and B are runs of different models: A {_model_label(a)}, B {_model_label(b)}"


def diff_reports(a: RunReport, b: RunReport) -> DiffSummary:
    """Every stage both runs have, on every scenario both have, judged as the module docstring says."""
    require_timings(a, "A")  # a zero or negative time is one line here, not a math error in a ratio below
    require_timings(b, "B")
    sa, sb = _stages(a), _stages(b)
    metric = b.settings.accuracy_metric
    names = [n for n in sb if n in sa]
    scenarios = [n for n in b.scenario_names if n in set(a.scenario_names)]

    def entries(name: str, scen: str) -> tuple[ScenarioMetrics | None, ScenarioMetrics | None]:
        return sa[name].scenario(scen), sb[name].scenario(scen)

    links: dict[tuple[str, str], tuple[float, float]] = {}  # (stage, scenario) -> (log B/A of its ratio, sigma)
    for scen in scenarios:
        for name in names:
            ea, eb = entries(name, scen)
            la, lb = (_link(ea), _link(eb)) if ea and eb else (None, None)
            if la and lb and sa[name].parent == sb[name].parent:
                links[(name, scen)] = (lb[0] - la[0], math.sqrt(la[1] ** 2 + lb[1] ** 2))
    control: dict[str, float] = {}  # scenario -> |log| of stage 0's raw P50 change
    source = sb[names[0]].name if names and sb[names[0]].index == 0 else None
    for scen in scenarios:
        ea, eb = entries(source, scen) if source else (None, None)
        if ea and eb:
            control[scen] = abs(math.log(eb.latency.p50_ms / ea.latency.p50_ms))
    # Passes timed against stage 0 itself: their ratio moves with stage 0's own between-run change.
    direct = {n for n in names if source and (up := sb[n].parent) and sb[up].measured_against == source}
    # Every row that gets a faster/slower verdict (all but stage 0): their intervals hold together.
    judged_rows = sum(1 for scen in scenarios for n in names if sb[n].index > 0 and all(entries(n, scen)))
    z = simultaneous_z(judged_rows)
    rows = []
    for scen in scenarios:
        for name in names:
            ea, eb = entries(name, scen)
            row = DiffRow(
                scenario=scen, stage=name, type=sb[name].type, status_a=sa[name].status, status_b=sb[name].status
            )
            if ea and eb:
                raw = ea.latency.p50_ms / eb.latency.p50_ms
                verdict: DiffVerdict
                if (name, scen) in links and sb[name].index > 0:
                    mu, sigma = links[(name, scen)]
                    tau = _between_runs({k: v[0] for k, v in links.items()}, name, direct)
                    widen = control.get(scen, 0.0) if name in direct else 0.0
                    half = z * math.sqrt(sigma**2 + tau**2) + widen
                    ratio, basis = math.exp(mu), "its own ratio vs its input (interleaved, both runs)"
                    low, high = math.exp(mu - half), math.exp(mu + half)
                    verdict = "faster" if low > 1.0 else "slower" if high < 1.0 else "within noise"
                    row.between_runs, row.control_widening = tau, widen
                else:
                    low, high, verdict = _verdict(ea, eb, z)
                    ratio = raw
                    basis = "raw P50 (the control, not judged)" if sb[name].index == 0 else "raw P50"
                    if sb[name].index == 0:
                        verdict = "control"
                if verdict in ("faster", "slower") and abs(math.log(ratio)) < math.log1p(MIN_EFFECT):
                    verdict = "within noise"
                row.p50_a, row.p50_b, row.raw_ratio, row.ratio = ea.latency.p50_ms, eb.latency.p50_ms, raw, ratio
                row.basis, row.low, row.high, row.verdict = basis, low, high, verdict
                row.vs_parent_a = ea.vs_parent.ratio if ea.vs_parent is not None else None
                row.vs_parent_b = eb.vs_parent.ratio if eb.vs_parent is not None else None
                row.vs_source_a, row.vs_source_b = sa[name].vs_source.get(scen), sb[name].vs_source.get(scen)
                row.cosine_a, row.cosine_b = _accuracy(sa[name].metrics, metric), _accuracy(sb[name].metrics, metric)
            rows.append(row)
    final = next((n for n in reversed(names) if sa[n].ok and sb[n].ok), None)
    totals = [r for r in rows if r.stage == final and r.ratio is not None]
    # Why, for the stages judged faster or slower between the runs, on each scenario where they were: their op
    # types and ORT nodes, A's profile against B's, per part (call; prefill and decode step; CUDA kernels).
    judged = [(r.stage, r.scenario) for r in rows if r.verdict in ("faster", "slower")]
    first = b.scenario_names[0] if b.scenario_names else ""
    op_changes = [
        OpChange(
            stage=n,
            scenario=scen,
            part=e.per,
            kind="kernels" if e.kernels else "ops",
            summary=e.summary(),
            coverage=e.coverage(),
            nodes=e.nodes.line() if e.nodes is not None else None,
            ops=[(r.op, r.parent_ms, r.stage_ms, r.delta_ms) for r in e.rows[:OP_ROWS]],
        )
        for n, scen in judged
        for e in between_runs(sa[n], sb[n], scen, first)
    ]
    return DiffSummary(
        a=RunSide(run_dir=a.run_dir, created=a.created, recipe=a.recipe.name),
        b=RunSide(run_dir=b.run_dir, created=b.created, recipe=b.recipe.name),
        only_in_a=[n for n in sa if n not in sb],
        only_in_b=[n for n in sb if n not in sa],
        rows=rows,
        machine_drift=machine_drift(a, b),
        final_stage=final,
        judged_rows=judged_rows,
        totals=totals,
        op_changes=op_changes,
    )


def regressions(d: DiffSummary, pct: float) -> list[str]:
    """Stages (and the final one) where B is slower than A by more than pct percent, beyond noise."""
    out = []
    for r in d.rows:
        if r.verdict == "slower" and r.ratio is not None and (1 / r.ratio - 1) * 100 > pct:
            out.append(
                f"{r.stage} on {r.scenario}: {100 * (1 / r.ratio - 1):.1f}% slower, {r.basis} "
                f"(P50 {r.p50_a:.2f} -> {r.p50_b:.2f} ms)"
            )
    return out


def _cell(r: DiffRow) -> dict[str, str]:
    if r.ratio is None or r.verdict is None:
        return {
            "scenario": r.scenario,
            "stage": r.stage,
            "A ms": "-",
            "B ms": "-",
            "A/B": "-",
            "verdict": f"{r.status_a} / {r.status_b}",
            "vs parent A -> B": "-",
            "accuracy A -> B": "-",
        }
    vp = (
        "-"
        if r.vs_parent_a is None or r.vs_parent_b is None
        else f"{r.vs_parent_a:.2f}x -> {r.vs_parent_b:.2f}x"
    )
    cos = "-" if r.cosine_a is None or r.cosine_b is None else f"{r.cosine_a:.5f} -> {r.cosine_b:.5f}"
    word = {"faster": "B faster", "slower": "B SLOWER", "within noise": "within noise", "control": "control"}[
        r.verdict
    ]
    return {
        "scenario": r.scenario,
        "stage": r.stage,
        "A ms": f"{r.p50_a:.2f}",
        "B ms": f"{r.p50_b:.2f}",
        "A/B": f"{r.ratio:.2f}x",
        "verdict": f"{word} ({r.low:.2f}-{r.high:.2f})",
        "vs parent A -> B": vp,
        "accuracy A -> B": cos,
    }


def _accuracy(metrics: StageMetrics | None, metric: str | None = None) -> float | None:
    """The accuracy figure a reader compares: the one the budget judges when the run names it (pooled cosine,
    top-1), greedy token agreement for generation (the logits cosine before the first divergence can stay high
    while the tokens differ), the cosine otherwise."""
    first = metrics.first_accuracy if metrics is not None else None
    if first is None:
        return None
    if metric and metric != "max_abs" and (value := first.figure(metric)) is not None:
        return value
    return first.token_agreement if first.token_agreement is not None else first.cosine


def to_markdown(d: DiffSummary) -> str:
    cols = ["scenario", "stage", "A ms", "B ms", "A/B", "verdict", "vs parent A -> B", "accuracy A -> B"]
    lines = [
        f"**A**: `{d.a.run_dir}` ({d.a.created}) vs **B**: `{d.b.run_dir}` ({d.b.created})",
        "",
        "A/B > 1 means B is faster. Each pass is judged by its own interleaved ratio against its input, B over A, "
        "so drift of the machine between the runs cancels; its interval is widened by how much the other "
        "passes' ratios moved between the runs, and the intervals of the "
        f"{d.judged_rows} judged rows hold together at 95% (Bonferroni). "
        f"Changes under {MIN_EFFECT:.0%} are within noise. Stage 0 is the control: its raw P50 change is shown, "
        "not judged."
        + (
            f" The fixed calibration workload ran {d.machine_drift:+.1%} from A to B."
            if d.machine_drift is not None
            else ""
        ),
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for r in d.rows:
        c = _cell(r)
        lines.append("| " + " | ".join(c[k] for k in cols) + " |")
    if d.totals:
        lines += [
            "",
            f"**Final stage `{d.final_stage}`**: "
            + "; ".join(
                f"{r.scenario} {r.p50_a:.2f} -> {r.p50_b:.2f} ms ({r.ratio:.2f}x, {r.verdict})"
                for r in d.totals
            ),
        ]
    for change in d.op_changes:
        where = f", on {change.scenario}" if change.scenario else ""
        what = "CUDA kernel" if change.kind == "kernels" else "op type"
        why = f"{change.summary} ({change.coverage})"
        lines += ["", f"**Why `{change.stage}` moved, by {what}{where}**: {why}"]
        if change.nodes:
            lines.append(f"  {change.nodes}")
    for names, label in ((d.only_in_a, "only in A"), (d.only_in_b, "only in B")):
        if names:
            lines.append(f"\nStages {label}: {', '.join(names)}")
    return "\n".join(lines)


def table_rows(d: DiffSummary) -> list[dict[str, str]]:
    return [_cell(r) for r in d.rows]
