"""Command line: optimizer compile | validate | passes."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table

from optimizer.core.errors import OptimizerError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Model optimization compiler.")
# Piped output (CI logs, files) gets a width that fits the stage table instead of rich's default 80.
out = Console() if Console().is_terminal else Console(width=220)
err = Console(stderr=True) if Console(stderr=True).is_terminal else Console(stderr=True, width=1000)
STATE: dict[str, Any] = {"debug": False, "history": None}


@app.callback()
def _main(
    debug: bool = typer.Option(False, "--debug", help="show tracebacks"),
    history: Path | None = typer.Option(None, "--history", help="run history database (default: user data dir)"),
) -> None:
    STATE["debug"] = debug
    STATE["history"] = history


def _fail(message: str, code: int) -> None:
    err.print(f"[red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _sigterm(*_: Any) -> None:
    raise KeyboardInterrupt


@app.command()
def validate(recipe: Path = typer.Argument(..., help="recipe YAML file")) -> None:
    """Check a recipe (and every pass config in it) without running anything."""
    from optimizer.recipe.loading import load_recipe

    r = load_recipe(recipe)
    stages = " -> ".join(["source", *(f"{p.stage_name}" + (f" (from {p.from_})" if p.from_ else "") for p in r.passes)])
    out.print(f"[green]ok[/] {recipe}: {len(r.passes)} passes, {len(r.scenarios)} scenarios: {stages}")


@app.command("compile")
def compile_(
    recipe: Path = typer.Argument(..., help="recipe YAML file"),
    out_dir: Path | None = typer.Option(None, "--out", help="run folder (default: runs/<recipe name>)"),
    no_cache: bool = typer.Option(False, "--no-cache", help="recompute every stage"),
    no_bench: bool = typer.Option(False, "--no-bench", help="build the artifacts only; measure nothing"),
    no_history: bool = typer.Option(False, "--no-history", help="do not record this run in the history"),
) -> None:
    """Run a recipe: every stage into its own folder, each benchmarked; prints the per-stage table."""
    from optimizer.cli.console import ConsoleEvents
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import load_recipe
    from optimizer.report.build import build_report, save_report, write_report

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

    with ConsoleEvents(out) as events:
        pipeline = Pipeline(r, run_dir, events, use_cache=not no_cache, measure=not no_bench)
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
        from optimizer.report.history import record

        try:
            report["history_id"] = record(report, STATE["history"])
        except OptimizerError as e:
            history_error = str(e)
    if report:
        show_report(report, run_dir)
    if history_error:
        err.print(f"[yellow]warning:[/] run not recorded in the run history: {history_error}", highlight=False,
                  soft_wrap=True)
    if write_errors and not save_error:
        err.print(f"[yellow]warning:[/] during the run: {write_errors[0]} (the final report was written)",
                  highlight=False, soft_wrap=True)
    if interrupted:
        _fail("interrupted; finished stages are kept and a re-run resumes from them", 130)
    if save_error:
        _fail(save_error, 1)
    source = report["stages"][0] if report else None
    if source and source["status"] == "failed" and source["notes"].get("error_kind") == "input":
        _fail(f"{recipe}: {source['reason']}", 2)
    if report and report["failed_stages"]:
        _fail(f"failed stages: {', '.join(report['failed_stages'])} (see the table above)", 1)


def show_report(report: dict[str, Any], run_dir: Path) -> None:
    """What a person reads after a compile (and from `optimizer report`): the stage tables, notes, findings."""
    from optimizer.cli.console import stage_tables, summary_table
    from optimizer.report.build import tail_note

    if report["outcome"] == "incomplete":
        from optimizer.engine.rundir import RunDir

        pending = [st["name"] for st in report["stages"] if st["status"] == "pending"]
        writer = RunDir(run_dir).writer_pid()
        state = f"still running (pid {writer})" if writer else "killed before it finished (no process holds it)"
        out.print(
            f"[yellow]outcome: incomplete[/]: the run was {state}; not reached: {', '.join(pending) or '-'}. "
            "Re-run the same compile to resume from the finished stages.", highlight=False,
        )
    for table in stage_tables(report):
        out.print(table)
    summary = summary_table(report)
    if summary is not None:
        out.print(summary)
    if STATE["debug"]:
        for st in report["stages"]:
            if st["notes"].get("traceback"):
                err.print(f"{st['name']}:\n{st['notes']['traceback']}", highlight=False, markup=False)
    out.print(
        "[dim]vs parent: stage and parent timed interleaved in one session (~ = within noise); "
        "P50/P99 come from that same session, so compare stages through the ratios.[/]"
    )
    note = tail_note(report)
    if note:
        out.print(f"[dim]{note}[/]", highlight=False)
    for line in report.get("findings", []):
        out.print(f"[yellow]![/] {line}", highlight=False)
    if (report.get("best") or {}).get("stage"):
        out.print(f"[bold]best[/]: {report['best']['why']}", highlight=False)
    run_id = report.get("history_id")
    out.print(
        f"report: {run_dir / 'report.json'}, {run_dir / 'report.md'}, {run_dir / 'report.html'}  "
        f"(wall time {report['wall_seconds']:.0f} s{f', run id {run_id}' if run_id else ''})"
    )


@app.command("report")
def report_(run: str = typer.Argument(..., help="run folder, report.json or run id")) -> None:
    """Show a run's tables and findings again (a run still going, or killed, says so)."""
    from optimizer.report.history import load_report

    report = load_report(run, STATE["history"])
    show_report(report, Path(report.get("run_dir") or run))


@app.command()
def passes() -> None:
    """List every registered pass and whether it can run on this machine."""
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
    out.print(table)


def main() -> None:
    import optimizer.cli.runs  # noqa: F401 - registers runs, diff, export, verify, bench

    try:
        rc = app(standalone_mode=False)
        sys.exit(rc if isinstance(rc, int) else 0)
    except OptimizerError as e:
        if STATE["debug"]:
            raise
        err.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        err.print("[red]error:[/] interrupted")
        sys.exit(130)
    except Exception as e:  # click usage errors and the unexpected: one line unless --debug
        if hasattr(e, "show") and isinstance(getattr(e, "exit_code", None), int):  # click's usage errors
            e.show()
            sys.exit(e.exit_code)
        if STATE["debug"]:
            raise
        err.print(f"[red]error:[/] {type(e).__name__}: {e} (run with --debug for the traceback)", highlight=False)
        sys.exit(1)
