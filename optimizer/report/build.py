"""The run report: build it from the stage records (RunReport, with its best stage, busy-machine summary and
findings) and write it out (report.json and its JSON Schema, report.md, report.html). Attribution: each stage's
speedup against its parent comes from timing the two interleaved; its speedup against stage 0 is the product of
those ratios along the chain of stages it descends from, so machine drift between distant stages never lands on
one pass."""

from __future__ import annotations

import datetime as dt
import platform
from collections.abc import Callable
from pathlib import Path

from optimizer import __version__
from optimizer.core.metrics import BatchSweep, ScenarioMetrics
from optimizer.core.stage import StageRecord, StageReport
from optimizer.engine.rundir import read_json, write_json, write_text
from optimizer.measure.best import best_stage
from optimizer.measure.instances import stage_reports
from optimizer.measure.scenario_best import advice, losses, scenario_winners
from optimizer.recipe.schema import Recipe, recipe_dict, recipe_metric
from optimizer.report.findings import findings, machine_busy
from optimizer.report.html import to_html
from optimizer.report.markdown import to_markdown
from optimizer.report.schema import (
    SCHEMA_NAME,
    SCHEMA_VERSION,
    Best,
    Environment,
    Machine,
    RecipeEcho,
    RunReport,
    ScenarioEcho,
    Settings,
    json_schema_text,
)
from optimizer.runtime.threads import target_threads


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
