"""Commands on recipes and their runs: validate, compile, report, passes.

Only typer and rich at import time (`optimizer --help` imports this): each command imports what does its work in
its body, so torch, onnx and onnxruntime load only for the commands that run models.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import typer

from optimizer.cli.options import fail, options
from optimizer.core.errors import OptimizerError

app = typer.Typer()


def _sigterm(*_: Any) -> None:
    raise KeyboardInterrupt


@app.command()
def validate(ctx: typer.Context, recipe: Path = typer.Argument(..., help="recipe YAML file")) -> None:
    """Check a recipe (and every pass config in it) without running anything."""
    from optimizer.recipe.loading import load_recipe

    r = load_recipe(recipe)
    stages = " -> ".join(["source", *(f"{p.stage_name}" + (f" (from {p.from_})" if p.from_ else "") for p in r.passes)])
    options(ctx).out.print(f"[green]ok[/] {recipe}: {len(r.passes)} passes, {len(r.scenarios)} scenarios: {stages}")


@app.command("compile")
def compile_(
    ctx: typer.Context,
    recipe: Path = typer.Argument(..., help="recipe YAML file"),
    out_dir: Path | None = typer.Option(None, "--out", help="run folder (default: runs/<recipe name>)"),
    no_cache: bool = typer.Option(False, "--no-cache", help="recompute every stage"),
    no_bench: bool = typer.Option(False, "--no-bench", help="build the artifacts only; measure nothing"),
    no_history: bool = typer.Option(False, "--no-history", help="do not record this run in the history"),
) -> None:
    """Run a recipe: every stage into its own folder, each benchmarked; prints the per-stage table."""
    from optimizer.cli.console import ConsoleEvents
    from optimizer.cli.show import show_report
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import load_recipe
    from optimizer.report.build import build_report, save_report, write_report
    from optimizer.report.history import record

    opts = options(ctx)
    r = load_recipe(recipe)
    run_dir = out_dir or Path("runs") / r.name
    start = time.perf_counter()
    signal.signal(signal.SIGTERM, _sigterm)
    write_errors: list[str] = []

    def write_progress(recs: list[Any]) -> None:
        """The report after each stage, marked incomplete. A failed write does not stop the run: the final write
        is tried all the same, and says what failed."""
        try:
            write_report(r, recs, run_dir, time.perf_counter() - start, in_progress=True)
        except OptimizerError as e:
            write_errors.append(str(e))

    # Without --debug the pipeline keeps its own default (OPTIMIZER_DEBUG, which the test suite sets).
    debug = True if opts.debug else None
    with ConsoleEvents(opts.out) as events:
        pipeline = Pipeline(r, run_dir, events, use_cache=not no_cache, measure=not no_bench, debug=debug)
        pipeline.on_stage_done.append(write_progress)
        interrupted = False
        try:
            records = pipeline.execute()
        except KeyboardInterrupt:
            interrupted, records = True, pipeline.records
    report = build_report(r, records, run_dir, time.perf_counter() - start) if records else None
    save_error: str | None = None
    if report is not None:
        try:
            save_report(report, run_dir)
        except OptimizerError as e:  # the results are shown all the same; the exit code says it
            save_error = str(e)
    history_error: str | None = None
    if report and not no_history:
        try:
            report.history_id = record(report, opts.history)
        except OptimizerError as e:
            history_error = str(e)
    if report:
        show_report(report, run_dir, opts)
    if history_error:
        opts.err.print(f"[yellow]warning:[/] run not recorded in the run history: {history_error}", highlight=False,
                       soft_wrap=True)
    if write_errors and not save_error:
        opts.err.print(f"[yellow]warning:[/] during the run: {write_errors[0]} (the final report was written)",
                       highlight=False, soft_wrap=True)
    if interrupted:
        fail(opts, "interrupted; finished stages are kept and a re-run resumes from them", 130)
    if save_error:
        fail(opts, save_error, 1)
    source = report.stages[0] if report else None
    if source and source.status == "failed" and source.notes.get("error_kind") == "input":
        fail(opts, f"{recipe}: {source.reason}", 2)
    if report and report.failed_stages:
        fail(opts, f"failed stages: {', '.join(report.failed_stages)} (see the table above)", 1)


@app.command("report")
def report_(ctx: typer.Context, run: str = typer.Argument(..., help="run folder, report.json or run id")) -> None:
    """Show a run's tables and findings again (a run still going, or killed, says so)."""
    from optimizer.cli.show import show_report
    from optimizer.report.history import load_report

    opts = options(ctx)
    report = load_report(run, opts.history)
    show_report(report, Path(report.run_dir or run), opts)


@app.command()
def passes(ctx: typer.Context) -> None:
    """List every registered pass and whether it can run on this machine."""
    from rich.table import Table

    from optimizer.core.registry import PASSES, pass_class

    table = Table(header_style="bold")
    for col in ("pass", "takes", "what it does", "on this machine"):
        table.add_column(col)
    for name in sorted(PASSES):
        cls = pass_class(name)
        reason = cls.environment_reason()
        table.add_row(
            name,
            "/".join(sorted(cls.consumes)),
            cls.summary,
            "[green]available[/]" if reason is None else f"[yellow]unavailable: {reason}[/]",
        )
    options(ctx).out.print(table)
