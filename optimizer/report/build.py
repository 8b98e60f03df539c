"""The run report: report.json (versioned schema) and report.md, rewritten after every stage.

Attribution: each stage's speedup against its parent comes from timing the two interleaved; its speedup
against stage 0 is the product of those ratios along the chain of stages it descends from, so machine
drift between distant stages never lands on one pass.
"""

from __future__ import annotations

import datetime as dt
import platform
from pathlib import Path
from typing import Any

from optimizer import __version__
from optimizer.core.stage import StageRecord
from optimizer.engine.rundir import read_json, write_json, write_text
from optimizer.measure.accuracy import recipe_metric
from optimizer.recipe.schema import Recipe, recipe_dict
from optimizer.runtime.threads import target_threads

SCHEMA_VERSION = 1
UNSTABLE_CV = 0.25  # like trtexec's variance warning: beyond this the latency distribution is not one number


def environment() -> dict[str, Any]:
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
    return {
        "optimizer": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "packages": versions,
    }


def _mean_ratio(m: dict[str, Any]) -> float | None:
    """Parent mean / stage mean from the same interleaved session: the throughput ratio for a fixed scenario
    (same work per call), tail included, free of the drift between separately measured stages."""
    parent = (m.get("parent_latency") or {}).get("mean_ms")
    mine = (m.get("latency") or {}).get("mean_ms")
    return parent / mine if parent and mine else None


def chained_speedups(
    records: list[StageRecord], ratio: Any = lambda m: (m.get("vs_parent") or {}).get("ratio")
) -> dict[str, dict[str, float]]:
    """stage -> scenario -> speedup against stage 0 (product of parent ratios along the chain)."""
    by_name = {r.name: r for r in records}
    out: dict[str, dict[str, float]] = {}
    for rec in records:
        if not rec.ok or not rec.metrics:
            continue
        if rec.index == 0:
            out[rec.name] = {s: 1.0 for s in rec.metrics.get("scenarios", {})}
            continue
        against = by_name[rec.parent].measured_against if rec.parent else None
        base = out.get(against or "", {})
        out[rec.name] = {}
        for scen, m in rec.metrics.get("scenarios", {}).items():
            r = ratio(m)
            if r and scen in base:
                out[rec.name][scen] = base[scen] * r
    return out


def build_report(
    recipe: Recipe, records: list[StageRecord], out_dir: Path, wall_seconds: float, in_progress: bool = False
) -> dict[str, Any]:
    """The run report. `in_progress`: written after a stage while the run goes on; its outcome is "incomplete"
    and the stages not reached are "pending", so a run killed outright (kill -9) never reads as ok."""
    chained = chained_speedups(records)
    chained_throughput = chained_speedups(records, _mean_ratio)
    stages = []
    for rec in records:
        d = rec.to_json()
        d["vs_source"] = chained.get(rec.name, {})
        d["throughput_vs_source"] = chained_throughput.get(rec.name, {})
        if in_progress and d["status"] == "not run" and not d.get("reason"):
            d["status"] = "pending"
        stages.append(d)
    failed = [r.name for r in records if r.status == "failed"]
    interrupted = any(r.status == "interrupted" for r in records)
    report = {
        "schema_version": SCHEMA_VERSION,
        "recipe": recipe_dict(recipe),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "run_dir": str(out_dir),
        "recipe_dir": str(recipe.base_dir),  # relative paths in the recipe (text files, models) resolve here
        "environment": environment(),
        "settings": {
            "device": recipe.target.device,
            "threads": target_threads(recipe),
            "benchmark": recipe.benchmark.model_dump(),
            "accuracy": recipe.accuracy.model_dump(),
            "accuracy_metric": recipe_metric(recipe),  # what the budget judges (the task's default when unset)
        },
        "scenarios": [s.model_dump() for s in recipe.scenarios],
        "stages": stages,
        "outcome": "interrupted" if interrupted else "incomplete" if in_progress else "failed" if failed else "ok",
        "failed_stages": failed,
        "wall_seconds": wall_seconds,
    }
    report["machine"] = {"calibration": read_json(out_dir / "machine.json")}
    sweep = read_json(out_dir / "batch_sweep.json") if recipe.batch_sweep else None
    if sweep:
        report["batch_sweep"] = sweep["result"]
    from optimizer.measure.best import best_stage

    best, why = best_stage(report)
    report["best"] = {"stage": best["name"] if best else None, "why": why}
    report["findings"] = findings(report)
    return report


def findings(report: dict[str, Any]) -> list[str]:
    """Plain sentences about what went wrong or backwards: failures, rejections, performance inversions."""
    from optimizer.measure.machine import busy_sentence, busy_summary, window_busy

    out: list[str] = []
    busy = busy_summary(report["stages"], (report.get("machine") or {}).get("calibration"))
    if busy:
        report.setdefault("machine", {})["busy"] = busy
        out.append(busy_sentence(busy))
    by_name = {st["name"]: st for st in report["stages"]}
    for st in report["stages"]:
        label = f"{st['name']} ({st['type']})"
        out += _launch_findings(st, by_name.get(st.get("parent") or ""), label)
        if st.get("reason") and (
            st["status"] in ("failed", "skipped", "interrupted") or st["reason"].startswith("not measured")
        ):
            out.append(f"{label} {st['status']}: {st['reason']}")
        m = st.get("metrics") or {}
        if m.get("nonfinite_reference"):
            out.append(
                f"{label} produces NaN/inf in {m['nonfinite_reference']} output elements on the recipe's inputs: every "
                "stage is compared against them, and NaN agrees with NaN, so accuracy figures cannot catch an error "
                "there; check the inputs (ranges, masks) or the model"
            )
        if m and not m.get("within_budget", True):
            out.append(f"{label} is REJECTED: accuracy outside the budget ({m.get('budget')})")
        for scen, sm in (m.get("scenarios") or {}).items():
            cv = (sm.get("latency") or {}).get("cv", 0.0)
            mixed = (sm.get("inputs") or {}).get("seq_min") != (sm.get("inputs") or {}).get("seq_max")
            # A busy machine is said once, above; a natural-length mix spreads by design.
            if cv > UNSTABLE_CV and not window_busy(m.get("machine_load")) and not mixed:
                out.append(
                    f"{label} on {scen}: timing was unstable (coefficient of variation {cv:.0%}); "
                    "treat its P99 with care, or raise benchmark.rounds / set benchmark.target_ci"
                )
            vs = sm.get("vs_parent")
            if vs and vs["verdict"] == "slower":
                out.append(
                    f"{label} on {scen}: {1 / vs['ratio']:.2f}x slower than its input "
                    f"({st['parent']}), beyond noise (CI {vs['low']:.2f}-{vs['high']:.2f}x)"
                )
    return out


MORE_LAUNCHES = 0.10  # a stage issuing >= 10% more kernel launches per call than its input is worth a line


def _kernels(st: dict[str, Any] | None, scenario: str) -> dict[str, Any] | None:
    sm = ((st or {}).get("metrics") or {}).get("scenarios", {}).get(scenario, {})
    k = sm.get("cuda_kernels")
    return k if k and "launches" in k else None


def _launch_findings(st: dict[str, Any], parent: dict[str, Any] | None, label: str) -> list[str]:
    """The seeds' "37% more kernel launches": said per scenario where a stage launches more than its input."""
    out = []
    for scen in (st.get("metrics") or {}).get("scenarios") or {}:
        mine, theirs = _kernels(st, scen), _kernels(parent, scen)
        if mine and theirs and theirs["launches"] > 0:
            more = mine["launches"] / theirs["launches"] - 1
            if more >= MORE_LAUNCHES:
                out.append(
                    f"{label} on {scen}: {more:.0%} more kernel launches per call than its input "
                    f"({parent['name']}): {mine['launches']:.0f} vs {theirs['launches']:.0f}"  # type: ignore[index]
                )
    return out


def kernels_cell(k: dict[str, Any] | None) -> str:
    """'412/3': kernels run on the device / launch calls the host made for them (a CUDA graph replay is one)."""
    return "-" if not k or "launches" not in k else f"{k['kernels']:.0f}/{k['launches']:.0f}"


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def scenario_title(report: dict[str, Any], scen: dict[str, Any]) -> str:
    """'b1-natural (batch 1, natural lengths 9-61 tokens, median 21, 32 inputs)' or '(batch 1, seq 128)'."""
    inputs = next(
        (
            sm["inputs"]
            for st in report["stages"]
            if (sm := ((st.get("metrics") or {}).get("scenarios") or {}).get(scen["name"])) and sm.get("inputs")
        ),
        {},
    )
    if inputs.get("padding") == "longest":
        shape = (
            f"natural lengths {inputs['seq_min']}-{inputs['seq_max']} tokens, median {inputs['seq_median']:g}, "
            f"{inputs['samples']} inputs timed in turn"
        )
    else:
        shape = f"seq {scen['seq']}" + (f", {inputs['samples']} inputs timed in turn" if inputs.get("samples") else "")
    return f"{scen['name']} (batch {scen['batch']}, {shape})"


def tail_cell(lat: dict[str, Any], key: str = "p99") -> str:
    """A tail percentile when its 95% interval is bounded by the calls taken, else 'n.r.' (not resolved)."""
    if not lat:
        return "-"
    if f"{key}_ci" in lat and lat[f"{key}_ci"] is None:
        return "n.r."
    return _fmt(lat.get(f"{key}_ms"))


def tail_note(report: dict[str, Any]) -> str | None:
    """The footnote for tables with an unresolved P99."""
    from optimizer.measure.stats import calls_to_resolve

    unresolved = [
        sm["latency"]["n"]
        for st in report["stages"]
        for sm in ((st.get("metrics") or {}).get("scenarios") or {}).values()
        if "p99_ci" in (sm.get("latency") or {}) and sm["latency"]["p99_ci"] is None
    ]
    if not unresolved:
        return None
    lo, hi = min(unresolved), max(unresolved)
    calls = f"{lo}" if lo == hi else f"{lo}-{hi}"
    return (
        f"P99 n.r.: not resolved. {calls} calls cannot bound a P99 (its 95% interval "
        f"needs at least {calls_to_resolve(0.99)}); set `benchmark: {{resolve_tail: true}}` to take enough."
    )


def speed_cell(vs: dict[str, Any] | None) -> str:
    """'1.32x' when beyond noise, '~1.01x' when within it."""
    if not vs:
        return "-"
    mark = "~" if vs["verdict"] == "within noise" else ""
    return f"{mark}{vs['ratio']:.2f}x"


def status_cell(stage: dict[str, Any], short: bool = False) -> str:
    status = stage["status"]
    if short or not stage.get("reason"):
        return status
    return f"{status}: {stage['reason']}"


def stage_rows(report: dict[str, Any], scenario: str) -> list[dict[str, str]]:
    """One row per stage for one scenario, as strings; shared by the terminal table and report.md. The accuracy
    column shows the figure the budget judges (its metric), so the column and the verdict beside it agree."""
    metric = (report.get("settings") or {}).get("accuracy_metric") or "cosine"
    if metric not in ("cosine", "pooled_cosine", "top1"):
        metric = "cosine"
    rows = []
    for st in report["stages"]:
        m = st.get("metrics") or {}
        sm = (m.get("scenarios") or {}).get(scenario, {})
        lat = sm.get("latency") or {}
        acc = m.get("accuracy") or {}
        first = next(iter(acc.values()), {}) if acc else {}
        size = m.get("size_bytes")
        vs0 = (st.get("vs_source") or {}).get(scenario)
        rows.append(
            {
                "stage": f"{st['index']:02d} {st['name']}",
                "parent": st.get("parent") or "-",
                "status": status_cell(st, short=True),
                "p50": _fmt(lat.get("p50_ms")),
                "p99": tail_cell(lat),
                "throughput": _fmt((sm.get("throughput") or {}).get("samples_per_s"), ".1f"),
                "vs_parent": speed_cell(sm.get("vs_parent")),
                "vs_source": "-" if vs0 is None else f"{vs0:.2f}x",
                "cosine": "-" if not first else f"{first.get(metric, first['cosine']):.6f}",
                "budget": "-" if not m else ("ok" if m.get("within_budget") else "REJECTED"),
                "size_mb": "-" if size is None else f"{size / 2**20:.1f}",
                "memory_mb": _fmt(m.get("memory_mb"), ".0f"),
                "ttft": _fmt((sm.get("ttft") or {}).get("p50_ms")),
                "tpot_p50": _fmt((sm.get("tpot") or {}).get("p50_ms")),
                "tpot_p99": tail_cell(sm.get("tpot") or {}),
                "tokens_per_s": _fmt((sm.get("throughput") or {}).get("tokens_per_s"), ".1f"),
                "agreement": "-" if "token_agreement" not in first else f"{first['token_agreement']:.3f}",
                "cv": "-" if not lat else f"{lat.get('cv', 0):.1%}",
                "kernels": kernels_cell(sm.get("cuda_kernels")),
            }
        )
    return rows


GENERATION_COLUMNS = [
    ("stage", "stage"),
    ("parent", "parent"),
    ("status", "status"),
    ("ttft", "TTFT P50 ms"),
    ("tpot_p50", "TPOT P50 ms"),
    ("tpot_p99", "TPOT P99 ms"),
    ("tokens_per_s", "tokens/s"),
    ("p50", "task P50 ms"),
    ("vs_parent", "vs parent"),
    ("vs_source", "vs stage 0"),
    ("agreement", "token agree"),
    ("cosine", "logits cos"),
    ("budget", "budget"),
    ("size_mb", "size MB"),
]


def columns(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's columns: generation runs show TTFT/TPOT/tokens/s instead of one-shot latency; CUDA runs add
    kernels run / host launches per call."""
    cols = GENERATION_COLUMNS if report["recipe"].get("workload") == "generation" else COLUMNS
    metric = (report.get("settings") or {}).get("accuracy_metric")
    if metric in ("pooled_cosine", "top1"):
        cols = [(k, metric if k == "cosine" else h) for k, h in cols]
    counted = any(
        "cuda_kernels" in sm
        for st in report["stages"]
        for sm in ((st.get("metrics") or {}).get("scenarios") or {}).values()
    )
    return [*cols, ("kernels", "kernels/launches")] if counted else cols


def scenario_summary(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Stage x scenario: speedup vs stage 0 (P50) in each cell, because a pass can help one scenario and hurt
    another. The speedup (chained interleaved ratios) leads: P50s of stages measured in different sessions
    carry the drift between those sessions, the ratios do not."""
    names = [s["name"] for s in report["scenarios"]]
    rows = []
    for st in report["stages"]:
        scen = (st.get("metrics") or {}).get("scenarios") or {}
        cells = [f"{st['index']:02d} {st['name']}"]
        for n in names:
            if n in scen:
                vs0 = (st.get("vs_source") or {}).get(n)
                p50 = f"{scen[n]['latency']['p50_ms']:.2f} ms"
                cells.append(f"{vs0:.2f}x ({p50})" if vs0 else p50)
            else:
                cells.append(st["status"])
        rows.append(cells)
    return ["stage", *names], rows


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


def to_markdown(report: dict[str, Any]) -> str:
    r = report
    lines = [
        f"# {r['recipe']['name']}: optimizer run",
        "",
        f"- outcome: **{r['outcome']}**, wall time {r['wall_seconds']:.0f} s",
        f"- device: {r['settings']['device']}, threads: {r['settings']['threads']}, cpu: {r['environment']['cpu']}",
        f"- packages: {', '.join(f'{k} {v}' for k, v in r['environment']['packages'].items())}",
        f"- benchmark: {r['settings']['benchmark']}",
        "- `~1.01x`: within noise (the confidence interval of the interleaved ratio includes 1.0).",
        "",
    ]
    for scen in r["scenarios"]:
        lines += [f"## Scenario {scenario_title(r, scen)}", ""]
        cols = columns(r)
        lines.append("| " + " | ".join(h for _, h in cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for row in stage_rows(r, scen["name"]):
            lines.append("| " + " | ".join(row[k].replace("|", "/") for k, _ in cols) + " |")
        lines.append("")
    note = tail_note(r)
    if note:
        lines += [note, ""]
    if r.get("best"):
        lines += [f"**Best stage**: {r['best']['why']}.", ""]
    if len(r["scenarios"]) > 1:
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
    sweep = r.get("batch_sweep")
    if sweep and sweep.get("rows"):
        lines += [
            f"## Batch sweep of `{sweep['stage']}` (seq {sweep['seq']})",
            "",
            "| batch | P50 ms | P99 ms | samples/s | memory growth MB |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {x['batch']} | {x['p50_ms']:.2f} | {x['p99_ms']:.2f} | {x['samples_per_s']:.1f} | "
            f"{x['memory_growth_mb']:.0f} |"
            for x in sweep["rows"]
        ]
        lines += ["", f"Recommendation: {sweep['why']}", ""]
    if r.get("findings"):
        lines += ["## Findings", ""] + [f"- {f}" for f in r["findings"]] + [""]
    lines += ["## Stages", ""]
    for st in r["stages"]:
        m = st.get("metrics") or {}
        lines.append(f"### {st['index']:02d} {st['name']} ({st['type']})")
        lines.append(
            f"- status: {status_cell(st)}; folder: `{st.get('folder') or '-'}`; parent: {st.get('parent') or '-'}"
        )
        if m.get("runtime"):
            lines.append(f"- runtime: {m['runtime']}")
        if m.get("graph"):
            per = "decode step" if m.get("workload") == "generation" else "call"
            graph = "prefill graph" if m.get("workload") == "generation" else "graph"
            lines.append(
                f"- nodes in the {graph}: {m['graph']['nodes']}; executed per {per}: "
                f"{m.get('nodes_executed') or '-'}; op types: {m['graph']['op_types']}"
            )
        mem = m.get("memory") or {}
        if mem.get("method") == "process":
            lines.append(
                f"- host memory (fresh process): peak {mem['peak_mb']:.0f} MB, resident after {mem['steady_mb']:.0f}"
                f" MB, above {mem['runtime_mb']:.0f} MB of runtime; in-process growth was {mem['inline_mb']:.0f} MB"
            )
        elif mem:
            lines.append(f"- host memory (in-process growth): {m['memory_mb']:.0f} MB {mem.get('reason', '')}".rstrip())
        if m.get("budget"):
            lines.append(f"- accuracy: {m['budget']} ({'within budget' if m.get('within_budget') else 'REJECTED'})")
        if st.get("pass_seconds") is not None:
            lines.append(
                f"- pass time: {st['pass_seconds']:.1f} s; benchmark time: {_fmt(st.get('bench_seconds'), '.1f')} s"
            )
        lines.append("")
    return "\n".join(lines)


def write_report(
    recipe: Recipe, records: list[StageRecord], out_dir: Path, wall_seconds: float, in_progress: bool = False
) -> dict[str, Any]:
    report = build_report(recipe, records, out_dir, wall_seconds, in_progress)
    save_report(report, out_dir)
    return report


def save_report(report: dict[str, Any], out_dir: Path) -> None:
    """report.json, then report.md, then report.html; a failed write is one OptimizerError naming the file."""
    write_json(out_dir / "report.json", report)
    write_text(out_dir / "report.md", to_markdown(report))
    from optimizer.report.html import to_html

    write_text(out_dir / "report.html", to_html(report))
