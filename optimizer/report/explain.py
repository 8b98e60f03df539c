"""Why a stage's speed changed: its time per op type against its parent's, from the runtime's own profiler.

Every stage is profiled on the first scenario's timing input by its own runtime (measure.forward,
measure.generation, measure.profiles): ONNX Runtime's profiler for ONNX stages, the PyTorch profiler for PyTorch
stages (the outermost aten ops: aten::linear, aten::softmax), and on CUDA the device time per kernel name (CUPTI),
whichever runtime launched them. A stage and its parent profiled by the same runtime are compared op type by op
type: the time in each, the signed difference, ordered by its size, and op types a pass introduced ("new") or
removed ("gone"). Two runtimes' op names are not one vocabulary (aten::linear is not a MatMul), so a stage against
a parent from another runtime (export against the PyTorch source) is compared by the profiles' totals and top ops
only, and says so; on CUDA the kernel names are shared, and that comparison is made as well, with the launches.
Generation stages are explained twice: one prefill call, and one decode step.

The profile's total change is set beside the change the harness measured on the same scenario (the interleaved
P50s of stage and parent: of a call, or of the time to first token for the prefill and per output token for a
decode step), which says how much of the measured ratio the profile accounts for. Profiled times leave out what
runs between ops (the runtime's own overhead, thread hand-offs, PyTorch's Python and dispatch), so the two need
not agree, and the sentence says how far they do.
"""

from __future__ import annotations

from dataclasses import dataclass

from optimizer.core.metrics import NodeTimes, ScenarioMetrics, ScenarioProfile, StageMetrics
from optimizer.core.stage import StageReport
from optimizer.measure.profiles import digest
from optimizer.report.schema import RunReport

NOISE_MS = 0.005  # op types whose time moved less than this are left out of the summary
RUNTIME = {"onnxruntime": "ONNX Runtime", "torch": "PyTorch", "cupti": "CUDA"}
PROFILER = {"onnxruntime": "ONNX Runtime profiler", "torch": "PyTorch profiler", "cupti": "CUDA kernels, CUPTI"}
MEASURED = {"call": "P50", "prefill": "TTFT P50", "decode step": "TPOT P50"}  # what the measured change is of


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


RENAMED = 0.05  # below this share of the parent's nodes still running by name, the pass renamed them: op types only
NODE_ROWS = 4  # nodes named per side in the one-line summary


@dataclass(frozen=True)
class NodeDiff:
    """ONNX Runtime's nodes matched by name: the slowest the stage runs that its parent did not (new), those the
    parent ran that the stage does not (gone), with their ms per call; `shared`: the share of the parent's nodes
    that still run by name."""

    new: list[tuple[str, str, float]]  # (node, op type, ms in the stage), slowest first
    gone: list[tuple[str, str, float]]  # (node, op type, ms in the parent), slowest first
    shared: float
    parent_nodes: int
    stage_nodes: int

    @property
    def renamed(self) -> bool:
        return self.parent_nodes > 0 and self.shared < RENAMED

    def line(self, n: int = NODE_ROWS) -> str:
        """'new nodes: Attention_0 +0.90 ms, ...; gone: /layer.0/MatMul -0.41 ms, ...'"""
        if self.renamed:
            return (
                f"nodes: all {self.stage_nodes} new and all {self.parent_nodes} gone ({self.shared:.0%} of the "
                "parent's node names still run: the pass renamed them), so by op type only"
            )

        def side(rows: list[tuple[str, str, float]], sign: str) -> str:
            shown = ", ".join(f"{short_node(name)} {sign}{ms:.3g} ms" for name, _, ms in rows[:n])
            return shown + (f" (+{len(rows) - n} more)" if len(rows) > n else "") if rows else "none"

        return f"new nodes: {side(self.new, '+')}; gone: {side(self.gone, '-')}"


def short_node(name: str, parts: int = 4) -> str:
    """An exporter's node path cut to its last parts ("…/layer.0/output/dense/MatMul_quant"): the line stays one."""
    steps = name.strip("/").split("/")
    return name if len(steps) <= parts else "…/" + "/".join(steps[-parts:])


def node_diff(parent: NodeTimes | None, stage: NodeTimes | None) -> NodeDiff | None:
    """Match two ORT node profiles by name (each keeps its slowest nodes and every node's digest)."""
    if parent is None or stage is None or not parent.digests or not stage.digests:
        return None
    ran_before, ran_after = set(parent.digests), set(stage.digests)
    new = [(n, op, ms) for n, op, ms in stage.top if digest(n) not in ran_before]
    gone = [(n, op, ms) for n, op, ms in parent.top if digest(n) not in ran_after]
    shared = len(ran_before & ran_after) / len(ran_before)
    return NodeDiff(new, gone, shared, parent.nodes, stage.nodes)


@dataclass(frozen=True)
class Explanation:
    stage: str
    parent: str
    scenario: str  # the profiled scenario (the recipe's first)
    per: str  # "call", "prefill" or "decode step"
    rows: list[OpDelta]  # by the size of the difference, largest first
    measured_delta_ms: float | None  # stage P50 - parent P50 (TTFT, TPOT), same interleaved session, same scenario
    sources: tuple[str, str] = ("onnxruntime", "onnxruntime")  # the parent's profiler, the stage's
    launches: tuple[float, float] | None = None  # CUDA kernel launches per call, parent and stage (forward)
    nodes: NodeDiff | None = None  # ONNX Runtime's nodes by name, where both profiles have them

    @property
    def comparable(self) -> bool:
        """Both profiles name the same things (one runtime's op types, or CUDA kernels)."""
        return self.sources[0] == self.sources[1]

    @property
    def kernels(self) -> bool:
        return self.sources[1] == "cupti"

    @property
    def parent_total_ms(self) -> float:
        return sum(r.parent_ms for r in self.rows)

    @property
    def stage_total_ms(self) -> float:
        return sum(r.stage_ms for r in self.rows)

    @property
    def profile_delta_ms(self) -> float:
        return sum(r.delta_ms for r in self.rows)

    def mark(self, r: OpDelta) -> str:
        """'new'/'gone' within one runtime; across two, the runtime whose profile holds the op."""
        if self.comparable:
            return r.change
        return RUNTIME.get(self.sources[1 if r.stage_ms > 0 else 0], "")

    def top(self, side: int, n: int = 3) -> list[tuple[str, float]]:
        """The largest op types of the parent's (0) or the stage's (1) profile."""
        ops = [(r.op, r.stage_ms if side else r.parent_ms) for r in self.rows]
        return sorted(((op, ms) for op, ms in ops if ms > 0), key=lambda x: -x[1])[:n]

    def summary(self, top: int = 4) -> str:
        """'fuse: -8.1 ms: Attention +4.2 ms (new), MatMul -6.0, Softmax -3.1, Transpose -2.2'"""
        head = f"{self.stage}: {self.profile_delta_ms:+.2f} ms per {self.per}"
        if not self.comparable:
            a, b = (RUNTIME.get(x, x) for x in self.sources)
            tops = [", ".join(f"{op} {ms:.3g}" for op, ms in self.top(side, max(top - 1, 1))) for side in (0, 1)]
            return (
                f"{head}, {a} {self.parent_total_ms:.3g} ms -> {b} {self.stage_total_ms:.3g} ms (profiles from two "
                f"runtimes, op types not matched): top {tops[0]} -> {tops[1]}"
            )
        moved = [r for r in self.rows if abs(r.delta_ms) >= NOISE_MS][:top]
        parts = [
            f"{r.op} {r.delta_ms:+.2f}{' ms' if i == 0 else ''}{f' ({r.change})' if r.change else ''}"
            for i, r in enumerate(moved)
        ]
        line = f"{head}{' in CUDA kernels' if self.kernels else ''}: " + (", ".join(parts) or "no op moved")
        if self.launches is not None and self.launches[0]:
            before, after = self.launches
            line += f"; kernel launches per call {before:.0f} -> {after:.0f} ({after / before - 1:+.0%})"
        return line

    def headline(self) -> str:
        """The summary short enough for a chart's title line: across two runtimes, the totals only (the bars
        below it are each profile's ops)."""
        if self.comparable:
            return self.summary(3)
        a, b = (RUNTIME.get(x, x) for x in self.sources)
        return (
            f"{self.stage}: {self.profile_delta_ms:+.2f} ms per {self.per}, {a} {self.parent_total_ms:.3g} ms -> "
            f"{b} {self.stage_total_ms:.3g} ms (two runtimes: ops not matched)"
        )

    def coverage(self) -> str:
        """How much of the measured change the profile accounts for."""
        measured = self.measured_delta_ms
        tool = PROFILER.get(self.sources[1], self.sources[1])
        if not self.comparable:
            tool = f"{PROFILER.get(self.sources[0], self.sources[0])} against {tool}"
        what = "op time" if "torch" in self.sources else "kernel time"
        profile = (
            f"the profile's {what} changed by {self.profile_delta_ms:+.2f} ms"
            if self.comparable
            else f"the two profiles' totals differ by {self.profile_delta_ms:+.2f} ms"
        )
        label = MEASURED.get(self.per, "P50")
        if measured is None:
            return f"{profile} ({self.scenario}, {tool})"
        if abs(measured) < NOISE_MS:
            return f"{profile}; the measured {label} did not move ({measured:+.3f} ms, {self.scenario})"
        share = self.profile_delta_ms / measured
        of = "" if label == "P50" else f"{label} "
        return f"{profile} of the measured {of}{measured:+.2f} ms ({share:.0%}, {self.scenario}, {tool})"


def _rows(before: dict[str, float], after: dict[str, float]) -> list[OpDelta]:
    return sorted(
        (OpDelta(op, before.get(op, 0.0), after.get(op, 0.0)) for op in {*after, *before}),
        key=lambda r: (-abs(r.delta_ms), r.op),
    )


Part = tuple[str, str]  # (per, kind): ("call" | "prefill" | "decode step", "ops" | "kernels")


def profile_on_scenario(m: StageMetrics, scenario: str, first: str) -> ScenarioProfile | None:
    """The stage's profile on one scenario: its own (ScenarioMetrics.profile); on the first scenario the
    stage-level fields, which hold it as they always have (reports from before every scenario was profiled have
    only those), with the nodes of its own profile."""
    sm = m.scenarios.get(scenario)
    own = sm.profile if sm is not None else None
    if scenario != first:
        return own
    return ScenarioProfile(
        source=m.op_time_source or (own.source if own is not None else None) or "onnxruntime",  # old: ORT only
        op_time_ms=m.op_time_ms,
        prefill_op_time_ms=m.prefill_op_time_ms,
        kernel_time_ms=m.kernel_time_ms,
        prefill_kernel_time_ms=m.prefill_kernel_time_ms,
        node_time=own.node_time if own is not None else None,
        prefill_node_time=own.prefill_node_time if own is not None else None,
        nodes_executed=m.nodes_executed,
    )


def _profiles(m: StageMetrics, p: ScenarioProfile | None) -> dict[Part, tuple[dict[str, float], str, NodeTimes | None]]:
    """(part, kind) -> (ms per name, profiler, ORT's nodes) for every profile a stage holds on one scenario."""
    if p is None:
        return {}
    source = p.source or "onnxruntime"
    main = "decode step" if m.workload == "generation" else "call"
    found = {
        ("prefill", "ops"): (p.prefill_op_time_ms, source, p.prefill_node_time),
        (main, "ops"): (p.op_time_ms, source, p.node_time),
        ("prefill", "kernels"): (p.prefill_kernel_time_ms, "cupti", None),
        (main, "kernels"): (p.kernel_time_ms, "cupti", None),
    }
    return {k: v for k, v in found.items() if v[0]}


def _measured_between(mine: ScenarioMetrics | None, theirs: ScenarioMetrics | None, per: str) -> float | None:
    """Stage P50 - the other's P50 of what `per` is: a call, the TTFT (prefill) or the TPOT (decode step)."""
    if mine is None or theirs is None:
        return None
    key = {"call": "latency", "prefill": "ttft", "decode step": "tpot"}[per]
    a, b = getattr(mine, key), getattr(theirs, key)
    return a.p50_ms - b.p50_ms if a is not None and b is not None else None


def _measured(st: StageMetrics, scen: str, per: str) -> float | None:
    sm = st.scenarios.get(scen)
    if sm is None:
        return None
    pairs = {
        "call": (sm.latency, sm.parent_latency),
        "prefill": (sm.ttft, sm.parent_ttft),
        "decode step": (sm.tpot, sm.parent_tpot),
    }
    mine, theirs = pairs[per]
    return mine.p50_ms - theirs.p50_ms if mine is not None and theirs is not None else None


def _launches(m: StageMetrics, scen: str) -> float | None:
    sm = m.scenarios.get(scen)
    k = sm.cuda_kernels if sm is not None else None
    return k.launches if k is not None else None


def _first(report: RunReport) -> str:
    return report.scenarios[0].name if report.scenarios else ""


def explain_all(report: RunReport, st: StageReport, scenario: str | None = None) -> list[Explanation]:
    """Every comparison the two profiles allow on one scenario (the first by default): per part (call; prefill and
    decode step), op types (with ORT's nodes by name) and, on CUDA, kernels. Empty when either has no profile."""
    parent = report.stage(st.parent or "")
    if st.metrics is None or parent is None or parent.metrics is None:
        return []
    first = _first(report)
    scen = scenario or first
    mine = _profiles(st.metrics, profile_on_scenario(st.metrics, scen, first))
    theirs = _profiles(parent.metrics, profile_on_scenario(parent.metrics, scen, first))
    out = []
    for (per, kind), (ms, source, nodes) in mine.items():
        if (per, kind) not in theirs:
            continue
        parent_ms, parent_source, parent_nodes = theirs[(per, kind)]
        before, after = _launches(parent.metrics, scen), _launches(st.metrics, scen)
        launches = (before, after) if kind == "kernels" and per == "call" and before and after else None
        measured = _measured(st.metrics, scen, per)
        rows = _rows(parent_ms, ms)
        nd = node_diff(parent_nodes, nodes) if source == parent_source else None
        out.append(
            Explanation(st.name, parent.name, scen, per, rows, measured, (parent_source, source), launches, nd)
        )
    return out


def explain_scenarios(report: RunReport, st: StageReport) -> dict[str, list[Explanation]]:
    """explain_all for every scenario of the run (those where both profiles exist)."""
    found = {s: explain_all(report, st, s) for s in report.scenario_names}
    return {s: e for s, e in found.items() if e}


def _main(found: list[Explanation]) -> list[Explanation]:
    out: list[Explanation] = []
    for e in found:
        same = next((i for i, o in enumerate(out) if o.per == e.per), None)
        if same is None:
            out.append(e)
        elif e.kernels:
            out[same] = e
    return out


def main_parts(report: RunReport, st: StageReport, scenario: str | None = None) -> list[Explanation]:
    """One explanation per part: CUDA kernels where both were traced (device time, one vocabulary for every
    runtime; ONNX Runtime's node times on CUDA are host-side), else the op types."""
    return _main(explain_all(report, st, scenario))


def explain(report: RunReport, st: StageReport) -> Explanation | None:
    """The stage against its parent (the first part), or None when either has no profile."""
    parts = main_parts(report, st)
    return parts[0] if parts else None


def between_runs(a: StageReport, b: StageReport, scenario: str, first: str | None = None) -> list[Explanation]:
    """One stage in run A and in run B (`optimizer diff`), on one scenario: which op types (and ORT nodes) got
    slower or faster between the runs, per part (call; prefill and decode step; CUDA kernels where traced). The
    measured change is the raw P50 difference of the part (call, TTFT, TPOT): two runs, not interleaved."""
    if a.metrics is None or b.metrics is None:
        return []
    first = first or scenario
    mine = _profiles(b.metrics, profile_on_scenario(b.metrics, scenario, first))
    theirs = _profiles(a.metrics, profile_on_scenario(a.metrics, scenario, first))
    sa, sb = a.metrics.scenarios.get(scenario), b.metrics.scenarios.get(scenario)
    out = []
    for (per, kind), (ms, source, nodes) in mine.items():
        if (per, kind) not in theirs:
            continue
        parent_ms, parent_source, parent_nodes = theirs[(per, kind)]
        before, after = _launches(a.metrics, scenario), _launches(b.metrics, scenario)
        launches = (before, after) if kind == "kernels" and per == "call" and before and after else None
        nd = node_diff(parent_nodes, nodes) if source == parent_source else None
        out.append(Explanation(
            f"{b.name} from A to B", f"{a.name} in A", scenario, per, _rows(parent_ms, ms),
            _measured_between(sb, sa, per), (parent_source, source), launches, nd,
        ))
    return out


def explanations(report: RunReport) -> list[Explanation]:
    return [e for st in report.stages if st.ok for e in explain_all(report, st)]


def _table(e: Explanation, top: int) -> list[str]:
    if not e.comparable:  # two runtimes: each profile's largest ops side by side, not matched
        a, b = (RUNTIME.get(x, x) for x in e.sources)
        left, right = e.top(0, top), e.top(1, top)
        lines = [f"| {e.parent} ({a}) | ms | {e.stage} ({b}) | ms |", "|---|---|---|---|"]
        for i in range(max(len(left), len(right))):
            x = left[i] if i < len(left) else ("", None)
            y = right[i] if i < len(right) else ("", None)
            cells = [f"{ms:.3f}" if ms is not None else "" for ms in (x[1], y[1])]
            lines.append(f"| {x[0]} | {cells[0]} | {y[0]} | {cells[1]} |")
        return [*lines, f"| total | {e.parent_total_ms:.3f} | total | {e.stage_total_ms:.3f} |"]
    name = "CUDA kernel" if e.kernels else "op type"
    lines = [f"| {name} | {e.parent} ms | {e.stage} ms | change ms |", "|---|---|---|---|"]
    for r in e.rows[:top]:
        mark = f" ({r.change})" if r.change else ""
        lines.append(f"| {r.op}{mark} | {r.parent_ms:.3f} | {r.stage_ms:.3f} | {r.delta_ms:+.3f} |")
    return lines


def markdown(report: RunReport, top: int = 6) -> list[str]:
    """The report.md section: per stage (and per prefill and decode step), on the first scenario the summary, the
    nodes a pass created or removed, the coverage and the largest differences; on every other scenario a line."""
    found = explanations(report)
    if not found:
        return []
    lines = ["## Why: each stage against its parent, by op type", ""]
    others = report.scenario_names[1:]
    for i, e in enumerate(found):
        lines += [f"**{e.summary()}** ({e.coverage()})", ""]
        if e.nodes is not None:
            lines += [f"{e.nodes.line()}", ""]
        lines += [*_table(e, top), ""]
        last = i + 1 == len(found) or found[i + 1].stage != e.stage
        st = report.stage(e.stage)
        if last and st is not None and others:
            lines += [
                f"- {scen}: {o.summary(3)} ({o.coverage()})" + (f"; {o.nodes.line(2)}" if o.nodes is not None else "")
                for scen in others
                for o in main_parts(report, st, scen)
            ] + [""]
    return lines
