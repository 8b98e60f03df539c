"""Why a stage's speed changed: its time per op type against its parent's, from the runtime's own profiler.

Every ONNX stage is profiled with ONNX Runtime's profiler on the first scenario's timing input (a separate,
profiled session: measure.forward / measure.generation), so a stage and its parent can be compared op type by op
type: the time in each, the signed difference, ordered by its size, and op types a pass introduced ("new") or
removed ("gone"). The profile's total change is set beside the change the harness measured on the same scenario
(the interleaved P50s of stage and parent), which says how much of the measured ratio the profile accounts for.
Kernel times leave out what runs between kernels (the runtime's own overhead, thread hand-offs), so the two need
not agree, and the sentence says how far they do. Stages without a profile (the PyTorch source) are not explained.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimizer.core.stage import StageReport
from optimizer.report.schema import RunReport

NOISE_MS = 0.005  # op types whose time moved less than this are left out of the summary


@dataclass(frozen=True)
class OpDelta:
    op: str
    parent_ms: float
    stage_ms: float

    @property
    def delta_ms(self) -> float:
        return self.stage_ms - self.parent_ms

    @property
    def change(self) -> str:
        """'new' (the parent ran none of it), 'gone' (the stage runs none), or ''."""
        return "new" if self.parent_ms == 0 < self.stage_ms else "gone" if self.stage_ms == 0 < self.parent_ms else ""


@dataclass(frozen=True)
class Explanation:
    stage: str
    parent: str
    scenario: str  # the profiled scenario (the recipe's first)
    per: str  # "call" or "decode step"
    rows: list[OpDelta]  # by the size of the difference, largest first
    measured_delta_ms: float | None  # stage P50 - parent P50, same interleaved session, same scenario

    @property
    def profile_delta_ms(self) -> float:
        return sum(r.delta_ms for r in self.rows)

    def summary(self, top: int = 4) -> str:
        """'fuse: -8.1 ms: Attention +4.2 ms (new), MatMul -6.0, Softmax -3.1, Transpose -2.2'"""
        moved = [r for r in self.rows if abs(r.delta_ms) >= NOISE_MS][:top]
        parts = [
            f"{r.op} {r.delta_ms:+.2f}{' ms' if i == 0 else ''}{f' ({r.change})' if r.change else ''}"
            for i, r in enumerate(moved)
        ]
        return f"{self.stage}: {self.profile_delta_ms:+.2f} ms per {self.per}: " + (", ".join(parts) or "no op moved")

    def coverage(self) -> str:
        """How much of the measured change the profile accounts for."""
        measured = self.measured_delta_ms
        profile = f"the profile's kernel time changed by {self.profile_delta_ms:+.2f} ms"
        if measured is None or self.per != "call":
            return f"{profile} ({self.scenario}, ONNX Runtime profiler)"
        if abs(measured) < NOISE_MS:
            return f"{profile}; the measured P50 did not move ({measured:+.3f} ms, {self.scenario})"
        share = self.profile_delta_ms / measured
        return f"{profile} of the measured {measured:+.2f} ms ({share:.0%}, {self.scenario}, ONNX Runtime profiler)"


def _rows(before: dict[str, float], after: dict[str, float]) -> list[OpDelta]:
    return sorted(
        (OpDelta(op, before.get(op, 0.0), after.get(op, 0.0)) for op in {*after, *before}),
        key=lambda r: (-abs(r.delta_ms), r.op),
    )


def explain(report: RunReport, st: StageReport) -> Explanation | None:
    """The stage against its parent, or None when either has no profile."""
    parent = report.stage(st.parent or "")
    if st.metrics is None or parent is None or parent.metrics is None:
        return None
    mine, theirs = st.metrics.op_time_ms, parent.metrics.op_time_ms
    if not mine or not theirs:
        return None
    rows = _rows(theirs, mine)
    scen = report.scenarios[0].name if report.scenarios else ""
    sm = st.metrics.scenarios.get(scen)
    measured = (
        sm.latency.p50_ms - sm.parent_latency.p50_ms if sm is not None and sm.parent_latency is not None else None
    )
    per = "decode step" if st.metrics.workload == "generation" else "call"
    return Explanation(st.name, parent.name, scen, per, rows, measured)


def between_runs(a: StageReport, b: StageReport, scenario: str) -> Explanation | None:
    """One stage in run A and in run B (`optimizer diff`): which op types got slower or faster between the runs.
    The measured change is the raw P50 difference on the profiled scenario (two runs: not interleaved)."""
    if a.metrics is None or b.metrics is None or not a.metrics.op_time_ms or not b.metrics.op_time_ms:
        return None
    sa, sb = a.metrics.scenarios.get(scenario), b.metrics.scenarios.get(scenario)
    measured = sb.latency.p50_ms - sa.latency.p50_ms if sa is not None and sb is not None else None
    per = "decode step" if b.metrics.workload == "generation" else "call"
    rows = _rows(a.metrics.op_time_ms, b.metrics.op_time_ms)
    return Explanation(f"{b.name} from A to B", f"{a.name} in A", scenario, per, rows, measured)


def explanations(report: RunReport) -> list[Explanation]:
    return [e for st in report.stages if st.ok and (e := explain(report, st)) is not None]


def markdown(report: RunReport, top: int = 6) -> list[str]:
    """The report.md section: per stage, the summary, the coverage and the largest differences."""
    found = explanations(report)
    if not found:
        return []
    lines = ["## Why: each stage against its parent, by op type", ""]
    for e in found:
        lines += [f"**{e.summary()}** ({e.coverage()})", "", f"| op type | {e.parent} ms | {e.stage} ms | change ms |"]
        lines.append("|---|---|---|---|")
        for r in e.rows[:top]:
            mark = f" ({r.change})" if r.change else ""
            lines.append(f"| {r.op}{mark} | {r.parent_ms:.3f} | {r.stage_ms:.3f} | {r.delta_ms:+.3f} |")
        lines.append("")
    return lines
