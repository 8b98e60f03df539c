"""`optimizer compare A B`: two models (ONNX files, or stages of runs) under one harness, interleaved, B against A.

Only typer and rich at import time; the command imports what does its work in its body.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import typer

from optimizer.cli.options import echo, fail, options
from optimizer.core.jsonio import strict_json_dumps

app = typer.Typer()


def _sigterm(*_: Any) -> None:
    raise KeyboardInterrupt


@app.command()
def compare(
    ctx: typer.Context,
    a: str = typer.Argument(..., help="the base model: an ONNX file, or RUN:stage (a run folder or id and a stage)"),
    b: str = typer.Argument(..., help="the variant: an ONNX file, or RUN:stage"),
    out_dir: Path | None = typer.Option(None, "--out", help="run folder (default: runs/compare-<A>-<B>)"),
    recipe: Path | None = typer.Option(
        None, "--recipe", help="take inputs, scenarios, accuracy, benchmark and target from this recipe"
    ),
    scenario: list[str] = typer.Option(
        [], "--scenario", help="symbolic dims of one scenario, e.g. batch=1,seq=128 (repeat for more)"
    ),
    fmt: str = typer.Option("table", "--format", help="table | md | json"),
    level: str = typer.Option(
        "all", "--ort-level", help="ORT graph optimization level for both: disable_all | basic | extended | all"
    ),
    bench: str | None = typer.Option(None, "--bench", help="benchmark settings, e.g. rounds=6,iterations=5"),
    threads: int | None = typer.Option(None, "--threads", help="intra-op threads (default: the recipe's, or all)"),
    device: str | None = typer.Option(None, "--device", help="cpu | cuda (default: the recipe's, or cpu)"),
    no_cache: bool = typer.Option(False, "--no-cache", help="measure again even if the run folder has the numbers"),
) -> None:
    """Run B against A under the same harness on the same inputs, interleaved: the B/A latency ratio per scenario
    with its interval and verdict, B's accuracy against A, and why by op type (A's profile against B's)."""
    from rich.table import Table

    from optimizer.cli.console import ConsoleEvents
    from optimizer.core.errors import OptimizerError
    from optimizer.engine.compare import compare_recipe, parse_bench
    from optimizer.engine.pipeline import Pipeline
    from optimizer.engine.rundir import write_json, write_text
    from optimizer.recipe.loading import load_recipe
    from optimizer.report.build import build_report, save_report
    from optimizer.report.compare import detail_lines, headline, op_rows, resolve_side, summarize, table_rows
    from optimizer.report.compare import to_markdown as compare_markdown

    opts = options(ctx)
    if fmt not in ("table", "md", "json"):
        raise OptimizerError(f"--format: {fmt!r} is not one of table, md, json")
    if device not in (None, "cpu", "cuda"):
        raise OptimizerError(f"--device: {device!r} is not one of cpu, cuda")
    side_a, side_b = resolve_side("A", a, opts.history), resolve_side("B", b, opts.history)
    base = load_recipe(recipe) if recipe is not None else None
    r, notes = compare_recipe(
        side_a, side_b, base=base, scenarios=scenario, level=level, bench=parse_bench(bench), threads=threads,
        device=device,
    )
    run_dir = out_dir or Path("runs") / r.name
    start = time.perf_counter()
    signal.signal(signal.SIGTERM, _sigterm)
    debug = True if opts.debug else None
    # Progress goes to stderr when stdout carries markdown or JSON.
    with ConsoleEvents(opts.out if fmt == "table" else opts.err) as events:
        pipeline = Pipeline(r, run_dir, events, use_cache=not no_cache, debug=debug)
        try:
            records = pipeline.execute()
        except KeyboardInterrupt:
            fail(opts, "interrupted; finished stages are kept and the same command resumes from them", 130)
    report = build_report(r, records, run_dir, time.perf_counter() - start)
    save_report(report, run_dir)
    # The generated recipe beside the report: `optimizer compile` on it reproduces the run.
    from optimizer.recipe.schema import recipe_dict

    write_text(run_dir / "compare.yaml", _yaml(recipe_dict(r)))
    s = summarize(report, side_a, side_b, notes)
    write_json(run_dir / "compare.json", s.to_json())
    write_text(run_dir / "compare.md", compare_markdown(s))
    source = report.stages[0]  # A itself did not run: nothing was compared, the error says why
    if source.status == "failed" and _ran_on_inputs(source.traceback or ""):
        given = "the recipe's inputs" if recipe is not None or any(x.recipe for x in (side_a, side_b)) \
            else "the generated inputs"
        fail(opts, f"A: {given} do not fit A ({source.reason}); give them with --recipe (inputs with a range or "
                   f"fill per input, or a data_file)", 2)
    if source.status == "failed":
        fail(opts, f"A: {source.reason}", 2 if source.error_kind == "input" else 1)
    if fmt == "json":
        echo(strict_json_dumps(s.to_json(), indent=2))
    elif fmt == "md":
        echo(compare_markdown(s))
    else:
        for line in headline(s):
            opts.out.print(line, highlight=False)
        rows = table_rows(s)
        if rows:
            table = Table(header_style="bold", caption="B/A > 1: B is slower; interval: 95% bootstrap over rounds")
            for col in rows[0]:
                table.add_column(col, justify="left" if col in ("scenario", "verdict") else "right")
            for row in rows:
                style = "red" if row["verdict"] == "B slower" else "green" if row["verdict"] == "B faster" else ""
                table.add_row(*row.values(), style=style)
            opts.out.print(table)
        for line in detail_lines(s):
            opts.out.print(line, highlight=False, soft_wrap=True)
        ops = op_rows(s)
        if ops:
            table = Table(header_style="bold", title="by op type (ONNX Runtime profile, first scenario)",
                          title_justify="left")
            for col in ops[0]:
                table.add_column(col, justify="left" if col == "op type" else "right")
            for row in ops:
                table.add_row(*row.values())
            opts.out.print(table)
        opts.out.print(f"report: {run_dir / 'report.md'}, {run_dir / 'report.html'}, {run_dir / 'compare.json'}")
    if s.status not in ("ran", "cached") or report.failed_stages:
        why = s.reason or ", ".join(report.failed_stages)
        b_stage = report.stage(s.b.stage)
        usage = b_stage is not None and b_stage.error_kind == "input"
        fail(opts, f"B was not measured against A: {why}", 2 if usage else 1)


def _ran_on_inputs(traceback: str) -> bool:
    """The failure came from running A's session on the inputs (it loaded: the inputs are what it refused)."""
    return "_sess.run(" in traceback


def _yaml(data: dict[str, Any]) -> str:
    from optimizer.core.markup import yaml_document

    return yaml_document(data, ["written by `optimizer compare`; `optimizer compile` on it reruns the comparison"])
