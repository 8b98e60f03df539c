"""`optimizer compare A B`: what the run of the generated recipe (engine/compare.py) says about B against A.

Per scenario the B/A latency ratio from the interleaved session with its interval and noise verdict (B/A > 1:
B is slower), B's accuracy against A's outputs, the op-type explanation (A's ONNX Runtime profile against B's,
report/explain.py), kernels per call (ORT's profile: the nodes it ran; on CUDA also the launches counted
through CUPTI), size and memory. The numbers are the report's; this module only reads and lays them out.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from optimizer.core.errors import OptimizerError
from optimizer.core.metrics import ClosedFacts
from optimizer.core.stage import StageReport, Status
from optimizer.engine.compare import A_STAGE, B_STAGE, CompareSide, file_side
from optimizer.recipe.schema import SOURCE_STAGE
from optimizer.report.explain import NOISE_MS, Explanation, explain, main_parts
from optimizer.report.schema import RunReport

ACCURACY_KEYS = ("cosine", "cosine_mean", "pooled_cosine", "max_abs", "max_rel", "top1")


class ComparedModel(ClosedFacts):
    """A or B: what the user named, the ONNX file run, and its stage in the compare run."""

    origin: str
    path: str
    stage: str


class ScenarioRow(ClosedFacts):
    """One scenario: both P50s from the interleaved session and B/A with its interval (> 1: B is slower)."""

    scenario: str
    p50_a_ms: float
    p50_b_ms: float
    ratio: float  # B/A latency
    low: float
    high: float
    verdict: Literal["B slower", "B faster", "within noise"]
    rounds: int | None
    launches_a: float | None  # CUDA kernel launches per call (None: not counted)
    launches_b: float | None
    launches: str  # the table's cell


class OpRow(ClosedFacts):
    """One op type's ms per call in A's profile and in B's."""

    op: str
    a_ms: float
    b_ms: float
    delta_ms: float
    change: str  # "new", "gone" or ""


class NodeRow(ClosedFacts):
    node: str
    op: str
    ms: float


class NodeChanges(ClosedFacts):
    """ONNX Runtime's nodes matched by name (report.explain.NodeDiff)."""

    line: str
    new: list[NodeRow]
    gone: list[NodeRow]
    shared: float
    renamed: bool


class CompareExplanation(ClosedFacts):
    """Why B's time differs from A's on one scenario and part, by op type or CUDA kernel (report.explain)."""

    scenario: str
    part: str  # "call", "prefill" or "decode step"
    summary: str
    coverage: str
    profile_delta_ms: float
    measured_delta_ms: float | None
    rows: list[OpRow]
    nodes: NodeChanges | None


class CountPair(ClosedFacts):
    a: int | None
    b: int | None


class FigurePair(ClosedFacts):
    a: float | None
    b: float | None


class CompareSummary(ClosedFacts):
    """Everything `optimizer compare` prints; compare.json is its `to_json()`. The fields after `explanation` are
    absent (not None) when B was not measured against A, and `budget`/`within_budget` when the run has no budget."""

    a: ComparedModel
    b: ComparedModel
    graph_optimization_level: str
    device: str
    threads: int
    run_dir: str
    notes: list[str]
    status: Status  # B's stage
    reason: str | None
    scenarios: list[ScenarioRow]
    accuracy: dict[str, dict[str, float]]  # output -> ACCURACY_KEYS measured -> value
    explanation: CompareExplanation | None  # the first scenario's
    budget: str | None = None
    within_budget: bool | None = None
    kernels_run: CountPair | None = None  # ONNX Runtime's nodes run per call
    size_mb: FigurePair | None = None
    memory_mb: FigurePair | None = None
    scenario_explanations: list[CompareExplanation] = []  # every other scenario


def resolve_side(label: str, spec: str, history: Path | None = None) -> CompareSide:
    """An ONNX file, or `RUN:stage` (a run folder, report.json or run id, and a stage name)."""
    from optimizer.report.history import load_report

    if Path(spec).is_file() or ":" not in spec:
        return file_side(label, spec)
    run, stage = spec.rsplit(":", 1)
    if not run or not stage:
        return file_side(label, spec)
    report = load_report(run, history)
    st = report.stage(stage)
    if st is None:
        known = ", ".join(s.name for s in report.stages)
        raise OptimizerError(f"{label}: run {run} has no stage {stage!r} (its stages: {known})")
    if st.status in ("skipped", "unchanged", "failed"):  # its artifact is its parent's (or nothing): not its own
        why = (st.reason or "no reason given").removeprefix(f"{stage}: ")
        if st.status == "failed":
            raise OptimizerError(f"{label}: stage {stage!r} of {run} failed ({why})")
        owner = report.stage(st.parent or "")
        while owner is not None and owner.status in ("skipped", "unchanged"):  # up to the stage that made the model
            owner = report.stage(owner.parent or "")
        whose = f"its parent {owner.name!r}'s" if owner is not None else "not its own"
        raise OptimizerError(f"{label}: stage {stage!r} of {run} was {st.status} ({why}); its model is {whose}")
    art = st.artifact
    if art is None or art.kind != "onnx" or art.path is None:
        kind = art.kind if art is not None else "no"
        raise OptimizerError(f"{label}: stage {stage!r} of {run} has {kind} artifact, not an ONNX file")
    if art.decode:
        raise OptimizerError(f"{label}: stage {stage!r} of {run} is a generation artifact; compare runs forward graphs")
    path = art.path
    if not path.is_file() and report.run_dir and st.folder:  # the run folder was moved since
        path = Path(report.run_dir) / st.folder / path.name
        if not path.is_file():
            path = Path(run) / st.folder / art.path.name
    if not path.is_file():
        raise OptimizerError(f"{label}: stage {stage!r} of {run}: its model file {art.path} is missing")
    recipe_dir = Path(report.recipe_dir) if report.recipe_dir else None
    return CompareSide(label, path.resolve(), spec, dict(art.runtime), report.recipe.model_dump(), recipe_dir)


def stages_of(report: RunReport) -> tuple[StageReport, StageReport]:
    """(A's stage, B's stage): A is "a" (A under the chosen ORT level) when the recipe has it, else stage 0."""
    a = report.stage(A_STAGE) or report.stage(SOURCE_STAGE)
    b = report.stage(B_STAGE)
    if a is None or b is None:
        raise OptimizerError(f"{report.run_dir}: not a compare run (no stages {A_STAGE!r}/{B_STAGE!r})")
    return a, b


def _launches(st: StageReport, scenario: str) -> float | None:
    sm = st.scenario(scenario)
    k = sm.cuda_kernels if sm is not None else None
    return k.launches if k is not None else None


def summarize(report: RunReport, a: CompareSide, b: CompareSide, notes: list[str]) -> CompareSummary:
    """Everything the command prints, typed; compare.json is its `to_json()`."""
    sa, sb = stages_of(report)
    level = (sa.artifact.runtime if sa.artifact is not None else {}).get("graph_optimization_level", "disable_all")
    out = CompareSummary(
        a=ComparedModel(origin=a.origin, path=str(a.path), stage=sa.name),
        b=ComparedModel(origin=b.origin, path=str(b.path), stage=sb.name),
        graph_optimization_level=level,
        device=report.settings.device,
        threads=report.settings.threads,
        run_dir=report.run_dir,
        notes=list(notes),
        status=sb.status,
        reason=sb.reason,
        scenarios=[],
        accuracy={},
        explanation=None,
    )
    if not sb.ok or sb.metrics is None or sa.metrics is None:
        if sb.ok and not sb.reason:
            out.reason = "not measured"
        if sa.status == "failed":
            out.reason = f"A ({sa.name}) failed: {sa.reason}"
        return out
    ma, mb = sa.metrics, sb.metrics
    cuda = report.settings.device == "cuda"
    scenarios = []
    for scen in report.scenario_names:
        sm = mb.scenarios.get(scen)
        if sm is None or sm.vs_parent is None or sm.parent_latency is None:
            continue
        vs = sm.vs_parent  # parent / stage: A's P50 over B's
        la, lb = _launches(sa, scen), _launches(sb, scen)
        scenarios.append(ScenarioRow(
            scenario=scen,
            p50_a_ms=sm.parent_latency.p50_ms,
            p50_b_ms=sm.latency.p50_ms,
            ratio=1 / vs.ratio,  # B/A latency: > 1 when B is slower
            low=1 / vs.high,
            high=1 / vs.low,
            verdict="B slower" if vs.verdict == "slower" else "B faster" if vs.verdict == "faster" else "within noise",
            rounds=sm.rounds,
            launches_a=la,
            launches_b=lb,
            launches=(f"{la:.0f} -> {lb:.0f} ({lb / la - 1:+.0%})" if la and lb is not None
                      else "not counted" if cuda else "n/a on cpu"),
        ))
    out.scenarios = scenarios
    out.accuracy = {
        name: {k: getattr(acc, k) for k in ACCURACY_KEYS if getattr(acc, k, None) is not None}
        for name, acc in mb.accuracy.items()
    }
    limits = report.settings.accuracy or {}
    if limits.get("min") is not None or limits.get("max") is not None:  # else there is no budget to be within
        out.budget, out.within_budget = mb.budget, mb.within_budget
    out.kernels_run = CountPair(a=ma.nodes_executed, b=mb.nodes_executed)
    size_a, size_b = (m.size_bytes / 2**20 if m.size_bytes else None for m in (ma, mb))
    out.size_mb = FigurePair(a=size_a, b=size_b)
    out.memory_mb = FigurePair(a=ma.memory_mb, b=mb.memory_mb)
    why = explain(report, sb)
    rows = {r.scenario: r for r in scenarios}
    if why is not None:
        out.explanation = _explanation(why, rows)
    out.scenario_explanations = [  # every other scenario: one line each (its rows in compare.json)
        _explanation(e, rows) for scen in report.scenario_names[1:] for e in main_parts(report, sb, scen)
    ]
    return out


def coverage_line(e: Explanation, row: ScenarioRow | None) -> str:
    """How much of the measured change the profile accounts for, in the table's own numbers (the same scenario's
    P50s and B/A ratio and its verdict), so a change tiny in ms but beyond noise never reads as 'did not move'."""
    if row is None or e.measured_delta_ms is None:
        return e.coverage()
    profile = dataclasses.replace(e, measured_delta_ms=None).coverage()  # "<profile's change> (scenario, tool)"
    pa, pb = row.p50_a_ms, row.p50_b_ms
    measured = pb - pa
    share = f"; the profile's change is {e.profile_delta_ms / measured:.0%} of it" if abs(measured) >= NOISE_MS else ""
    digits = 4 if max(pa, pb) < 0.1 else 3  # enough that the two P50s show the delta between them
    return (f"{profile}; measured P50 {pa:.{digits}f} -> {pb:.{digits}f} ms ({measured:+.{digits}f} ms, "
            f"B/A {row.ratio:.2f}x: {row.verdict}){share}")


def _explanation(e: Explanation, rows: dict[str, ScenarioRow]) -> CompareExplanation:
    e = dataclasses.replace(e, stage="B", parent="A")
    nodes = e.nodes
    return CompareExplanation(
        scenario=e.scenario,
        part=e.per,
        summary=e.summary(),
        coverage=coverage_line(e, rows.get(e.scenario) if e.per == "call" else None),
        profile_delta_ms=e.profile_delta_ms,
        measured_delta_ms=e.measured_delta_ms,
        rows=[OpRow(op=r.op, a_ms=r.parent_ms, b_ms=r.stage_ms, delta_ms=r.delta_ms, change=r.change)
              for r in e.rows],
        nodes=None if nodes is None else NodeChanges(
            line=nodes.line(),
            new=[NodeRow(node=n, op=op, ms=ms) for n, op, ms in nodes.new],
            gone=[NodeRow(node=n, op=op, ms=ms) for n, op, ms in nodes.gone],
            shared=nodes.shared,
            renamed=nodes.renamed,
        ),
    )


def _pct(a: float | None, b: float | None) -> str:
    return f"{a:.0f} -> {b:.0f} ({b / a - 1:+.0%})" if a and b is not None else "-"


def headline(s: CompareSummary) -> list[str]:
    """The lines above and below the table: what ran, how, accuracy, kernels, size, memory."""
    return [
        f"A: {s.a.origin} (stage {s.a.stage})  B: {s.b.origin} (stage {s.b.stage})",
        f"both run by ONNX Runtime with graph_optimization_level={s.graph_optimization_level}, "
        f"threads: {s.threads}, on {s.device}, same inputs, interleaved rounds (ABBA)",
    ]


def detail_lines(s: CompareSummary) -> list[str]:
    lines = []
    for name, acc in s.accuracy.items():
        figures = ", ".join(f"{k} {v:.6g}" for k, v in acc.items())
        lines.append(f"accuracy of B against A, {name}: {figures}")
    if s.budget:
        lines.append(f"budget: {s.budget} ({'within' if s.within_budget else 'REJECTED'})")
    k = s.kernels_run
    if k is not None:
        lines.append(f"kernels run per call (ONNX Runtime profile): {_pct(k.a, k.b)}")
    size, mem = s.size_mb, s.memory_mb
    if size is not None:
        lines.append(f"size on disk: {_mb(size.a)} -> {_mb(size.b)} MB; memory (peak of serving): "
                     f"{_mb(mem.a if mem is not None else None)} -> {_mb(mem.b if mem is not None else None)} MB")
    e = s.explanation
    if e is not None:
        lines.append(f"why, by op type: {e.summary} ({e.coverage})")
        if e.nodes is not None:
            lines.append(f"by node: {e.nodes.line}")
    else:
        lines.append("why, by op type: no profile of both stages")
    for o in s.scenario_explanations:
        lines.append(f"why on {o.scenario}: {o.summary} ({o.coverage})"
                     + (f"; {o.nodes.line}" if o.nodes is not None else ""))
    lines += [f"note: {n}" for n in s.notes]
    return lines


def _mb(x: float | None) -> str:
    return f"{x:.1f}" if x is not None else "-"


def table_rows(s: CompareSummary) -> list[dict[str, str]]:
    return [
        {
            "scenario": r.scenario,
            "A P50 ms": f"{r.p50_a_ms:.3f}",
            "B P50 ms": f"{r.p50_b_ms:.3f}",
            "B/A latency": f"{r.ratio:.2f}x",
            "95% interval": f"{r.low:.2f}-{r.high:.2f}",
            "verdict": r.verdict,
            "kernel launches/call": r.launches,
        }
        for r in s.scenarios
    ]


def op_rows(s: CompareSummary, top: int = 8) -> list[dict[str, str]]:
    e = s.explanation
    if e is None:
        return []
    return [
        {"op type": r.op + (f" ({r.change})" if r.change else ""), "A ms": f"{r.a_ms:.3f}",
         "B ms": f"{r.b_ms:.3f}", "B - A ms": f"{r.delta_ms:+.3f}"}
        for r in e.rows[:top]
    ]


def to_markdown(s: CompareSummary) -> str:
    lines = ["# optimizer compare", ""] + [f"- {x}" for x in headline(s)] + [""]
    if s.status not in ("ran", "cached") or s.reason:
        lines += [f"**B {s.status}**: {s.reason or '-'}", ""]
    rows = table_rows(s)
    if rows:
        lines += ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        lines += ["| " + " | ".join(r.values()) + " |" for r in rows] + [""]
        lines += ["B/A > 1: B is slower; interval: 95% bootstrap over the interleaved rounds.", ""]
    lines += [f"- {x}" for x in detail_lines(s)] + [""]
    ops = op_rows(s, top=12)
    if ops:
        lines += ["| " + " | ".join(ops[0]) + " |", "|" + "---|" * len(ops[0])]
        lines += ["| " + " | ".join(r.values()) + " |" for r in ops] + [""]
    return "\n".join(lines)
