"""The run report: build it from the stage records (RunReport), its findings, report.md; write all three files.

Attribution: each stage's speedup against its parent comes from timing the two interleaved; its speedup
against stage 0 is the product of those ratios along the chain of stages it descends from, so machine
drift between distant stages never lands on one pass.
"""

from __future__ import annotations

import datetime as dt
import platform
from collections.abc import Callable
from pathlib import Path

from optimizer import __version__
from optimizer.core.metrics import BatchSweep, CudaKernels, ScenarioMetrics, StageMetrics
from optimizer.core.stage import StageRecord, StageReport
from optimizer.engine.rundir import read_json, write_json, write_text
from optimizer.measure.best import best_stage
from optimizer.measure.denormal_probe import PENALTY_FLOOR
from optimizer.measure.instances import stage_reports
from optimizer.measure.machine import busy_sentence, busy_summary, window_busy
from optimizer.measure.scenario_best import advice, losses, scenario_winners
from optimizer.recipe.schema import Recipe, recipe_dict, recipe_metric
from optimizer.report.explain import main_parts
from optimizer.report.explain import markdown as explain_markdown
from optimizer.report.html import to_html
from optimizer.report.schema import (
    SCHEMA_NAME,
    SCHEMA_VERSION,
    Best,
    BusySummary,
    Environment,
    Machine,
    RecipeEcho,
    RunReport,
    ScenarioEcho,
    Settings,
    json_schema_text,
)
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
from optimizer.runtime.threads import target_threads
from passes.fuse import FuseNotes
from passes.fuse.kernel_choice import KernelChoiceNote

UNSTABLE_CV = 0.25  # like trtexec's variance warning: beyond this the latency distribution is not one number


def environment() -> Environment:
    import importlib.metadata as md

    versions = {}
    for pkg in ("torch", "onnx", "onnxruntime", "onnxruntime-gpu", "transformers", "tensorrt", "numpy"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            continue
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return Environment(
        optimizer=__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        cpu=cpu,
        packages=versions,
    )


def _parent_ratio(sm: ScenarioMetrics) -> float | None:
    return sm.vs_parent.ratio if sm.vs_parent is not None else None


def _mean_ratio(sm: ScenarioMetrics) -> float | None:
    """Parent mean / stage mean from the same interleaved session: the throughput ratio for a fixed scenario
    (same work per call), tail included, free of the drift between separately measured stages."""
    parent = sm.parent_latency.mean_ms if sm.parent_latency is not None else None
    mine = sm.latency.mean_ms
    return parent / mine if parent and mine else None


def chained_speedups(
    stages: list[StageReport], ratio: Callable[[ScenarioMetrics], float | None] = _parent_ratio
) -> dict[str, dict[str, float]]:
    """stage -> scenario -> speedup against stage 0 (product of parent ratios along the chain)."""
    by_name = {s.name: s for s in stages}
    out: dict[str, dict[str, float]] = {}
    for st in stages:
        if not st.ok or st.metrics is None:
            continue
        if st.index == 0:
            out[st.name] = {s: 1.0 for s in st.metrics.scenarios}
            continue
        against = by_name[st.parent].measured_against if st.parent else None
        base = out.get(against or "", {})
        out[st.name] = {}
        for scen, sm in st.metrics.scenarios.items():
            r = ratio(sm)
            if r and scen in base:
                out[st.name][scen] = base[scen] * r
    return out


def build_report(
    recipe: Recipe, records: list[StageRecord], out_dir: Path, wall_seconds: float, in_progress: bool = False
) -> RunReport:
    """The run report. `in_progress`: written after a stage while the run goes on; its outcome is "incomplete"
    and the stages not reached are "pending", so a run killed outright (kill -9) never reads as ok."""
    stages = stage_reports(records, recipe.benchmark.confidence)  # intervals with the spread between sessions
    chained, chained_throughput = chained_speedups(stages), chained_speedups(stages, _mean_ratio)
    for st in stages:
        st.vs_source = chained.get(st.name, {})
        st.throughput_vs_source = chained_throughput.get(st.name, {})
        if in_progress and st.status == "not run" and not st.reason:
            st.status = "pending"
    failed = [r.name for r in records if r.status == "failed"]
    interrupted = any(r.status == "interrupted" for r in records)
    machine = Machine.model_validate({"calibration": read_json(out_dir / "machine.json")})
    report = RunReport(
        schema_version=SCHEMA_VERSION,
        recipe=RecipeEcho.model_validate(recipe_dict(recipe)),
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        run_dir=str(out_dir),
        recipe_dir=str(recipe.base_dir),
        environment=environment(),
        settings=Settings(
            device=recipe.target.device,
            threads=target_threads(recipe),
            benchmark=recipe.benchmark.model_dump(),
            accuracy=recipe.accuracy.model_dump(),
            accuracy_metric=recipe_metric(recipe),  # what the budget judges (the task's default when unset)
        ),
        scenarios=[ScenarioEcho.model_validate(s.model_dump()) for s in recipe.scenarios],
        stages=stages,
        outcome="interrupted" if interrupted else "incomplete" if in_progress else "failed" if failed else "ok",
        failed_stages=failed,
        wall_seconds=wall_seconds,
        machine=machine,
    )
    sweep = read_json(out_dir / "batch_sweep.json") if recipe.batch_sweep else None
    if sweep:
        report.batch_sweep = BatchSweep.model_validate(sweep["result"])
    report.best = best_with_scenarios(report)
    busy = machine_busy(report)
    if busy is not None:
        machine.busy = busy
    report.findings = findings(report)
    return report


def best_with_scenarios(report: RunReport) -> Best:
    """The overall best (measure.best) with each scenario's winner (stage 0 included); its sentence says where it
    loses, beyond noise, to another stage or to stage 0, and what a deployment can do when the winners differ."""
    stages, names = report.stages, report.scenario_names
    best, why = best_stage(stages, names)
    winners = scenario_winners(stages, names) if len(names) > 1 else {}
    lost = losses(stages, best.name, winners) if best is not None else []
    if lost:
        why += "; but " + "; ".join(x.sentence() for x in lost)
    return Best(stage=best.name if best else None, why=why, per_scenario=winners, losses=lost,
                advice=advice(stages, report.scenarios, winners, lost))


def machine_busy(report: RunReport) -> BusySummary | None:
    """measure.machine's one statement about a busy machine, over this report's stages (None when it was quiet)."""
    loads = [
        {"name": st.name, "metrics": {"machine_load": st.metrics.machine_load.to_json()}}
        for st in report.stages
        if st.metrics is not None and st.metrics.machine_load is not None
    ]
    calibration = report.machine.calibration if report.machine is not None else None
    busy = busy_summary(loads, calibration.to_json() if calibration is not None else None)
    return BusySummary.model_validate(busy) if busy else None


def _window_busy(st: StageReport) -> bool:
    load = st.metrics.machine_load if st.metrics is not None else None
    return window_busy(load.to_json() if load is not None else None)


def _kernel_choices(stage: StageReport) -> list[KernelChoiceNote]:
    """A fuse stage's measured rules (passes/fuse/kernel_choice.py), read through its notes model."""
    if "kernel_choice" not in stage.notes:
        return []
    return list((FuseNotes.model_validate(stage.notes).kernel_choice or {}).values())


def findings(report: RunReport) -> list[str]:
    """Plain sentences about what went wrong or backwards: failures, rejections, performance inversions."""
    out: list[str] = []
    busy = machine_busy(report)
    if busy is not None:
        out.append(busy_sentence(busy.to_json()))
    by_name = {st.name: st for st in report.stages}
    flushing = [st.name for st in report.stages if st.ok and st.artifact is not None
                and st.artifact.runtime.get("denormal_as_zero")]
    for st in report.stages:
        label = f"{st.name} ({st.type})"
        out += _launch_findings(st, by_name.get(st.parent or ""), label)
        out += _denormal_findings(st, label, flushing)
        for choice in _kernel_choices(st):
            if not choice.kept:
                why = "its kernel measured slower on this target than the ops it replaces"
                out.append(f"{label}: a fusion left out ({why}): {choice.line}")
        said_why = st.status in ("failed", "skipped", "unchanged", "interrupted")
        if st.reason and (said_why or st.reason.startswith("not measured")):
            out.append(f"{label} {st.status}: {st.reason}")
        m = st.metrics
        if m is None:
            continue
        if m.nonfinite_reference:
            out.append(
                f"{label} produces NaN/inf in {m.nonfinite_reference} output elements on the recipe's inputs: every "
                "stage is compared against them, and NaN agrees with NaN, so accuracy figures cannot catch an error "
                "there; check the inputs (ranges, masks) or the model"
            )
        if not m.within_budget:
            out.append(f"{label} is REJECTED: accuracy outside the budget ({m.budget})")
        elif m.budget_edge:
            out.append(f"{label} is at the accuracy budget's edge: within it by its worst sample, not known to be "
                       f"({m.budget}); more accuracy samples would resolve it")
        for scen, sm in m.scenarios.items():
            mixed = sm.inputs is not None and sm.inputs.seq_min != sm.inputs.seq_max
            # A busy machine is said once, above; a natural-length mix spreads by design.
            if sm.latency.cv > UNSTABLE_CV and not _window_busy(st) and not mixed:
                out.append(
                    f"{label} on {scen}: timing was unstable (coefficient of variation {sm.latency.cv:.0%}); "
                    "treat its P99 with care, or raise benchmark.rounds / set benchmark.target_ci"
                )
            out += _parent_drift(st, by_name.get(st.parent or ""), scen, sm, label)
            vs = sm.vs_parent
            if vs is not None and vs.verdict == "slower":
                why = main_parts(report, st, scen)  # one per part: the call, or the prefill and the decode step
                out.append(
                    f"{label} on {scen}: {1 / vs.ratio:.2f}x slower than its input "
                    f"({st.parent}), beyond noise (CI {vs.low:.2f}-{vs.high:.2f}x)"
                    + "".join(
                        f"; by op type, {e.summary(3)} ({e.coverage()})"
                        + (f"; {e.nodes.line(2)}" if e.nodes is not None else "")
                        for e in why
                    )
                )
    return out


PARENT_DRIFT = 3.0  # the parent's P50 beside a stage against its own: beyond this factor the ratio is not trusted


def _parent_drift(st: StageReport, parent: StageReport | None, scen: str, sm: ScenarioMetrics, label: str) -> list[str]:
    """The interleaved ratio assumes the parent ran beside the stage as it runs alone; when its P50 there is far
    from its own measurement (a tiny PyTorch model beside ONNX Runtime on a loaded machine ran 200x slower), the
    ratio measures the disturbance, not the stage."""
    own_sm = parent.scenario(scen) if parent is not None else None
    beside = sm.parent_latency.p50_ms if sm.parent_latency is not None else None
    own = own_sm.latency.p50_ms if own_sm is not None else None
    if parent is None or not beside or not own or max(beside / own, own / beside) <= PARENT_DRIFT:
        return []
    ratio = f" {sm.vs_parent.ratio:.2f}x" if sm.vs_parent is not None else ""
    return [
        f"{label} on {scen}: its input ({parent.name}) ran {beside:.3g} ms (P50) beside this stage against "
        f"{own:.3g} ms on its own ({beside / own:.1f}x): the ratio{ratio} is unreliable; re-run on a quiet machine"
    ]


DENORMAL_GAIN = 1.10  # a stage >= 10% faster (and beyond noise) with denormals flushed is worth a line


def _denormal_findings(st: StageReport, label: str, flushing: list[str]) -> list[str]:
    """Where the denormal probe (measure.denormal_probe) found the stage faster with denormals flushed: one line
    per stage, every such scenario with its figure, and what to do about it."""
    parts = []
    for scen, sm in (st.metrics.scenarios if st.metrics is not None else {}).items():
        vs = sm.denormal_probe
        if vs is None or vs.verdict != "faster" or vs.ratio < DENORMAL_GAIN:
            continue
        padded = sm.inputs.padded_share if sm.inputs is not None else None
        pad = f", {padded:.0%} of positions padding" if padded else ""
        parts.append(f"{scen} {vs.ratio:.2f}x (CI {vs.low:.2f}-{vs.high:.2f}x{pad})")
    if not parts:
        return []
    fix = (f"the run's {', '.join(flushing)} flush{'es' if len(flushing) == 1 else ''} them"
           if flushing else "an ort_session stage with `denormal_as_zero: true` flushes them, measured as a stage")
    return [f"{label} runs faster with denormal floats flushed to zero: {'; '.join(parts)}. It computes on "
            f"denormal numbers (on padded inputs: the masked attention probabilities); {fix}"]


MORE_LAUNCHES = 0.10  # a stage issuing >= 10% more kernel launches per call than its input is worth a line


def _kernels(st: StageReport | None, scenario: str) -> CudaKernels | None:
    sm = st.scenario(scenario) if st is not None else None
    k = sm.cuda_kernels if sm is not None else None
    return k if k is not None and k.launches is not None else None


def _launch_findings(st: StageReport, parent: StageReport | None, label: str) -> list[str]:
    """The seeds' "37% more kernel launches": said per scenario where a stage launches more than its input."""
    out = []
    for scen in st.metrics.scenarios if st.metrics is not None else {}:
        mine, theirs = _kernels(st, scen), _kernels(parent, scen)
        if mine and theirs and parent is not None and theirs.launches:
            more = mine.launches / theirs.launches - 1  # type: ignore[operator]
            if more >= MORE_LAUNCHES:
                out.append(
                    f"{label} on {scen}: {more:.0%} more kernel launches per call than its input "
                    f"({parent.name}): {mine.launches:.0f} vs {theirs.launches:.0f}"
                )
    return out


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
        "",
    ]
    for scen in r.scenarios:
        lines += [f"## Scenario {scenario_title(r, scen)}", ""]
        cols = columns(r)
        lines.append("| " + " | ".join(h for _, h in cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for row in stage_rows(r, scen.name):
            lines.append("| " + " | ".join(row[k].replace("|", "/") for k, _ in cols) + " |")
        lines.append("")
    note = tail_note(r)
    if note:
        lines += [note, ""]
    lines += tpot_lines(r)
    if r.best is not None:
        lines += [f"**Best stage**: {r.best.why}.", ""]
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
            + ["| " + " | ".join(row) + " |" for row in rows]
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
        lines += [f"| {x.batch} | skipped: {x.reason} | | | |" for x in sweep.skipped or []]
        lines += ["", f"Recommendation: {sweep.why}", ""]
    if r.findings:
        lines += ["## Findings", ""] + [f"- {f}" for f in r.findings] + [""]
    lines += explain_markdown(r)
    lines += ["## Stages", ""]
    for st in r.stages:
        lines.append(f"### {st.index:02d} {st.name} ({st.type})")
        lines.append(f"- status: {status_cell(st)}; folder: `{st.folder or '-'}`; parent: {st.parent or '-'}")
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
        lines.append(f"| {scen} | {name} | {w.ratio:.2f}x ({w.low:.2f}-{w.high:.2f}) | {note.replace('|', '/')} |")
    lines.append("")
    if best.advice:
        lines += [f"**Per scenario**: the winners differ: {best.advice}. "
                  "`optimizer export RUN --stage best --scenario NAME` exports a scenario's winner.", ""]
    return lines


def _metrics_lines(m: StageMetrics) -> list[str]:
    lines = []
    if m.runtime:
        lines.append(f"- runtime: {m.runtime}")
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
        lines.append(f"- host memory (in-process growth): {m.memory_mb:.0f} MB {mem.reason or ''}".rstrip())
    if m.budget:
        verdict = "within budget" if m.within_budget else "REJECTED"
        lines.append(f"- accuracy: {m.budget} ({verdict}{', at the edge' if m.budget_edge else ''})")
    return lines


def write_report(
    recipe: Recipe, records: list[StageRecord], out_dir: Path, wall_seconds: float, in_progress: bool = False
) -> RunReport:
    report = build_report(recipe, records, out_dir, wall_seconds, in_progress)
    save_report(report, out_dir)
    return report


def save_report(report: RunReport, out_dir: Path) -> None:
    """report.json and its JSON Schema, then report.md, then report.html; a failed write is one OptimizerError
    naming the file."""
    write_json(out_dir / "report.json", report.to_json())
    write_text(out_dir / SCHEMA_NAME, json_schema_text())
    write_text(out_dir / "report.md", to_markdown(report))
    write_text(out_dir / "report.html", to_html(report))
