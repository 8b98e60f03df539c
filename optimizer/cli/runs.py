"""Commands on finished runs: runs, diff, export, verify, bench, select (merged into the root app by app.py).

Only typer and rich at import time; each command imports what does its work in its body.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from optimizer.cli.options import echo, error_line, fail, options, styled, warning_line
from optimizer.core.errors import OptimizerError
from optimizer.core.jsonio import strict_json_dumps

app = typer.Typer()


@app.command()
def runs(
    ctx: typer.Context,
    recipe: str | None = typer.Option(None, "--recipe", help="only runs of this recipe name"),
    limit: int = typer.Option(20, "--limit"),
) -> None:
    """List recorded runs (newest first); their ids work with `diff` and `export`."""
    from rich.table import Table

    from optimizer.report.history import default_path, list_runs

    opts = options(ctx)
    table = Table(header_style="bold", title=str(opts.history or default_path()), title_justify="left")
    for col in ("id", "created", "recipe", "model", "device", "outcome", "run folder"):
        table.add_column(col)
    for r in list_runs(opts.history, recipe, limit):
        table.add_row(str(r["id"]), r["created"], r["recipe"], r["model"], r["device"], r["outcome"], r["run_dir"])
    opts.out.print(table)


@app.command()
def diff(
    ctx: typer.Context,
    a: str = typer.Argument(..., help="run folder, report.json or run id"),
    b: str = typer.Argument(..., help="run folder, report.json or run id"),
    fmt: str = typer.Option("table", "--format", help="table | md | json"),
    fail_on_regression: float | None = typer.Option(
        None, "--fail-on-regression", help="exit 3 when any stage is slower by more than PCT percent, beyond noise"
    ),
    allow_different_models: bool = typer.Option(
        False, "--different-models", help="compare runs of two different models anyway (ratios are not pass effects)"
    ),
) -> None:
    """Compare two runs stage by stage: latency both sides, ratio, noise verdict, accuracy change."""
    from rich.table import Table

    from optimizer.report.diff import diff_reports, different_models, regressions, table_rows, to_markdown
    from optimizer.report.history import load_report

    opts = options(ctx)
    if fmt not in ("table", "md", "json"):
        raise OptimizerError(f"--format: {fmt!r} is not one of table, md, json")
    ra, rb = load_report(a, opts.history), load_report(b, opts.history)
    mismatch = different_models(ra, rb)
    if mismatch and not allow_different_models:
        raise OptimizerError(f"{mismatch}; their stages are not the same computation (--different-models to compare)")
    d = diff_reports(ra, rb)
    if mismatch and fmt != "json":
        opts.out.print(styled(("note:", "yellow"), f" {mismatch}: the ratios below compare two models, not passes"))
    if fmt == "json":
        echo(strict_json_dumps(d.to_json(), indent=2))
    elif fmt == "md":
        echo(to_markdown(d))
    else:
        rows = table_rows(d)
        table = Table(
            header_style="bold",
            title=f"A: {d.a.run_dir}  vs  B: {d.b.run_dir}",
            title_justify="left",
            caption="A/B > 1: B is faster; interval: 95% bootstrap of the ratio",
        )
        for col in rows[0] if rows else []:
            table.add_column(col, justify="left" if col in ("scenario", "stage", "verdict") else "right")
        for row in rows:
            style = "red" if "SLOWER" in row["verdict"] else "green" if "faster" in row["verdict"] else ""
            table.add_row(*row.values(), style=style)
        opts.out.print(table)
        for r in d.totals:
            opts.out.print(
                f"final stage {d.final_stage} on {r.scenario}: {r.p50_a:.2f} -> {r.p50_b:.2f} ms "
                f"({r.ratio:.2f}x, {r.verdict})"
            )
        for change in d.op_changes:
            where = ", ".join(v for v in (change.scenario, change.part) if v)
            by = "kernel" if change.kind == "kernels" else "op type"
            opts.out.print(f"why {change.stage} moved ({where}), by {by}: {change.summary} "
                           f"({change.coverage})", highlight=False, soft_wrap=True)
            if change.nodes:
                opts.out.print(f"  {change.nodes}", highlight=False, soft_wrap=True)
    if fail_on_regression is not None:
        found = regressions(d, fail_on_regression)
        if found:
            fail(opts, f"regression beyond {fail_on_regression}%: " + "; ".join(found), 3)


@app.command("export")
def export_(
    ctx: typer.Context,
    run: str = typer.Argument(..., help="run folder, report.json or run id"),
    stage: str = typer.Option("best", "--stage", help="stage name, or best: fastest within the accuracy budget"),
    fmt: str = typer.Option(
        "auto", "--format", help="auto (the stage's own) | onnx | tensorrt | triton | openvino | genai"),
    out_dir: Path = typer.Option(..., "--out", help="bundle folder (must be new or empty)"),
    scenario: str | None = typer.Option(
        None, "--scenario", help="with --stage best: the fastest stage within the budget in this scenario"),
) -> None:
    """Write a deployable bundle: model, manifest.json (checksums, I/O, numbers), reference inputs/outputs."""
    from optimizer.deploy.staging import Interrupts

    if fmt not in ("auto", "onnx", "tensorrt", "triton", "openvino", "genai"):
        raise OptimizerError(f"--format: {fmt!r} is not one of auto, onnx, tensorrt, triton, openvino, genai")
    opts = options(ctx)
    interrupts = Interrupts().install()  # Ctrl-C and SIGTERM: exit 130, the staging folder removed
    try:
        # what the export runs, imported before it writes anything: an import cut short by Ctrl-C leaves a
        # half-initialised extension module behind, which can crash the process later
        import onnxruntime  # noqa: F401
        import polygraphy.comparator  # noqa: F401

        from optimizer.deploy.export import export_bundle
        from optimizer.report.history import load_report

        root = export_bundle(load_report(run, opts.history), stage, fmt, out_dir, scenario, interrupts)
    except BaseException:
        if not interrupts.fired:
            raise
        # Cleaned up already (the exception unwound the staging folder); no interpreter teardown after an
        # interrupt, which may have cut an extension module's initialisation short.
        opts.err.print(error_line(f"interrupted; nothing was written to {out_dir}"), soft_wrap=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    interrupts.ignore()
    manifest = json.loads((root / "manifest.json").read_text())
    opts.out.print(styled(("exported", "green"), f" {root} ({manifest.get('format', fmt)})"))
    budget = manifest.get("accuracy_budget") or {}
    if budget.get("within") is False:
        opts.err.print(warning_line(f"stage {manifest.get('stage')}: {budget.get('verdict')}"), soft_wrap=True)


@app.command()
def verify(ctx: typer.Context, bundle: Path = typer.Argument(..., help="bundle folder")) -> None:
    """Check a bundle: every checksum, then its outputs on the reference inputs within the recorded tolerance."""
    from optimizer.deploy.verify import unchecked_reason, verify_bundle

    opts = options(ctx)
    problems = verify_bundle(bundle)
    if problems:
        fail(opts, f"{bundle}: " + "; ".join(problems), 1)
    reason = unchecked_reason(bundle)
    if reason:
        opts.out.print(styled(("ok", "green"), f" {bundle}: checksums match; outputs not checked here: {reason}"))
        return
    opts.out.print(styled(("ok", "green"), f" {bundle}: checksums match, outputs within tolerance"))


@app.command()
def bench(
    ctx: typer.Context,
    bundle: Path = typer.Argument(..., help="bundle folder"),
    rounds: int = typer.Option(10, "--rounds", min=1),
    iterations: int = typer.Option(10, "--iterations", min=1),
) -> None:
    """Time a bundle on its reference inputs with the benchmark harness."""
    from optimizer.deploy.bench import bench_bundle

    for scen, m in bench_bundle(bundle, rounds, iterations).items():
        lat, rec = m["latency"], m["recorded_p50_ms"]
        gen = f", TTFT P50 {m['ttft']['p50_ms']:.2f} ms, TPOT P50 {m['tpot']['p50_ms']:.2f} ms" if "ttft" in m else ""
        options(ctx).out.print(
            f"{scen}: P50 {lat['p50_ms']:.2f} ms, P99 {lat['p99_ms']:.2f} ms, CV {lat['cv']:.2%}{gen}"
            + (f" (recorded at compile: P50 {rec:.2f} ms)" if rec else "")
        )


@app.command()
def select(
    ctx: typer.Context,
    run: str = typer.Argument(..., help="run folder, report.json or run id"),
    weights: str = typer.Option(
        "seed-latency",
        "--weights",
        help="seed-latency | seed-deploy | term=weight,... (latency, throughput, accuracy, "
        "memory, size, deployability)",
    ),
) -> None:
    """Rank the stages of a run per scenario by a composite score, and say which to deploy and why."""
    from rich.table import Table

    from optimizer.report.history import load_report
    from optimizer.report.select import parse_weights, rank, recommend

    try:
        w = parse_weights(weights)
    except ValueError as e:
        raise OptimizerError(f"--weights: {e}") from None
    opts = options(ctx)
    report = load_report(run, opts.history)
    for scen, rows in rank(report, w).items():
        table = Table(
            title=f"{scen}: score = " + " + ".join(f"{v:g} x {k}" for k, v in w.items()),
            title_justify="left",
            header_style="bold",
        )
        for col in ("stage", "score", *w.keys(), "budget"):
            table.add_column(col, justify="left" if col == "stage" else "right")
        for r in rows:
            table.add_row(
                r.stage,
                f"{r.score:.3f}",
                *(f"{r.terms[k]:.3f}" for k in w),
                "ok" if r.within_budget else "REJECTED",
            )
        opts.out.print(table)
    _, lines = recommend(report, w)
    for line in lines:
        opts.out.print(line, highlight=False)
