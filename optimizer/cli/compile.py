"""Commands on recipes and their runs: validate, compile, report, passes.

Only typer and rich at import time (`optimizer --help` imports this): each command imports what does its work in
its body, so torch, onnx and onnxruntime load only for the commands that run models.
"""

from __future__ import annotations

import contextlib
import signal
import time
from pathlib import Path
from typing import Any

import typer

from optimizer.cli.options import error_line, fail, options, styled, warning_line
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
    options(ctx).out.print(styled(("ok", "green"), f" {recipe}: {len(r.passes)} passes, {len(r.scenarios)} scenarios: "
                                  f"{stages}"), soft_wrap=True)


@app.command("compile")
def compile_(
    ctx: typer.Context,
    recipes: list[Path] = typer.Argument(None, help="recipe YAML files, or folders of them (their *.yaml)"),
    model: str | None = typer.Option(
        None, "--model", help="instead of a recipe: a Hugging Face folder, an .onnx file or module:function, compiled "
        "with a generated recipe (written into the run folder as recipe.yaml)"
    ),
    device: str | None = typer.Option(None, "--device", help="with --model: the target, cpu (default) or cuda"),
    mlflow_uri: str | None = typer.Option(
        None, "--mlflow", help="also log each run to MLflow at URI (a parent run, a nested run per stage)"
    ),
    out_dir: Path | None = typer.Option(
        None, "--out", help="run folder (default: runs/<recipe name>); with several recipes, DIR/<recipe name>"
    ),
    no_cache: bool = typer.Option(False, "--no-cache", help="recompute every stage"),
    no_bench: bool = typer.Option(False, "--no-bench", help="build the artifacts only; measure nothing"),
    no_history: bool = typer.Option(False, "--no-history", help="do not record this run in the history"),
    workers: int = typer.Option(
        1, "--workers", min=1, help="recipes built at once; with one recipe, processes its passes' independent "
        "evaluations spread over (the hybrid search's nodes). Timings still take turns: one bench slot per host"
    ),
    backend: str = typer.Option("local", "--backend", help="local (a process pool) or ray"),
    address: str | None = typer.Option(
        None, "--address", help="with --backend ray: the cluster to join (default: a local Ray started here)"
    ),
) -> None:
    """Run recipes: every stage into its own folder, each benchmarked; prints the per-stage table."""
    from optimizer.recipe.loading import load_recipe

    opts = options(ctx)
    if backend not in ("local", "ray"):
        fail(opts, f"--backend {backend!r}: one of local, ray", 2)
    if address is not None and backend != "ray":
        fail(opts, "--address is for --backend ray (the Ray cluster to join)", 2)
    if device is not None and model is None:
        fail(opts, "--device is for --model; a recipe names its device in target.device", 2)
    if mlflow_uri:  # before any work: a store that is down would otherwise fail only after the whole compile
        from optimizer.report.mlflow_log import check_uri

        check_uri(mlflow_uri)
    if model is not None:
        if recipes:
            fail(opts, "give recipe files or --model, not both", 2)
        from optimizer.cli.auto_compile import prepare_model_recipe

        device = device or "cpu"
        generated = prepare_model_recipe(model, device, out_dir, measure=not no_bench)
        opts.out.print(f"recipe for {model} ({device}): {generated}", highlight=False, soft_wrap=True)
        recipes, out_dir = [generated], generated.parent
    elif not recipes:
        fail(opts, "give a recipe file (or a folder of them), or --model PATH", 2)
    paths = _recipe_paths(recipes, opts)
    if len(paths) == 1 and backend == "local":  # --workers N: the pipeline's fan-out (the hybrid search's nodes)
        r = load_recipe(paths[0])
        run_dir = out_dir or Path("runs") / r.name
        _check_run_dirs([run_dir])
        _compile_one(opts, paths[0], r, run_dir, no_cache, no_bench, no_history, mlflow_uri, workers)
        return
    loaded, codes = _load_all(paths, opts)
    run_dirs = {path: (out_dir or Path("runs")) / r.name for path, r in loaded.items()}
    if len(paths) == 1 and out_dir is not None:
        run_dirs = {path: out_dir for path in loaded}
    _check_run_dirs(list(run_dirs.values()))
    if workers == 1 and backend == "local":
        for path, r in loaded.items():
            codes.append(_exit_code(opts, lambda p=path, r=r: _compile_one(  # type: ignore[misc]
                opts, p, r, run_dirs[p], no_cache, no_bench, no_history, mlflow_uri)))
            if codes[-1] == 130:  # interrupted: the recipes after it are not started
                break
    else:
        pooled, interrupted = _compile_pooled(
            opts, loaded, run_dirs, workers, backend, address, no_cache, no_bench, no_history, mlflow_uri
        )
        codes += pooled
        if interrupted:  # the exit code says so even when every recipe had finished
            failing = sum(1 for c in codes if c)
            fail(opts, f"interrupted: {len(paths) - failing} of {len(paths)} recipes finished cleanly", 130)
    worst = max(codes, default=0)
    if worst:
        failing = sum(1 for c in codes if c)
        fail(opts, f"{failing} of {len(paths)} recipes did not finish cleanly (see above)", worst)


def _check_run_dirs(run_dirs: list[Path]) -> None:
    """Before anything runs: a run folder that is a folder of the user's files is refused (the pipeline refuses it
    too; here it is also the driver's, which workers on other hosts send their results into)."""
    from optimizer.engine.rundir import check_run_folder

    for run_dir in run_dirs:
        check_run_folder(run_dir)


def _recipe_paths(recipes: list[Path], opts: Any) -> list[Path]:
    """The recipe files: each file as given, each folder's *.yaml in name order."""
    paths: list[Path] = []
    for item in recipes:
        if item.is_dir():
            found = sorted([*item.glob("*.yaml"), *item.glob("*.yml")])
            if not found:
                fail(opts, f"{item}: a folder without recipes (*.yaml)", 2)
            paths += found
        else:
            paths.append(item)
    return list(dict.fromkeys(paths))


def _load_all(paths: list[Path], opts: Any) -> tuple[dict[Path, Any], list[int]]:
    """The recipes that load (a bad one is its error line and exit code 2, the others still run); two recipes of
    one name would write one run folder: refused."""
    from optimizer.recipe.loading import load_recipe

    loaded: dict[Path, Any] = {}
    codes: list[int] = []
    names: dict[str, Path] = {}
    for path in paths:
        try:
            r = load_recipe(path)
        except OptimizerError as e:
            opts.err.print(error_line(str(e)), soft_wrap=True)
            codes.append(2)
            continue
        if r.name in names:
            fail(opts, f"{path}: name {r.name!r} is also {names[r.name]}'s: each recipe needs its own run folder", 2)
        names[r.name] = path
        loaded[path] = r
    return loaded, codes


def _exit_code(opts: Any, run: Any) -> int:
    """The exit code a compile of one recipe would give (its messages printed as usual); an error of ours is its
    line and 2, as `optimizer` itself would exit, and the next recipe still runs."""
    try:
        run()
    except typer.Exit as e:
        return int(e.exit_code)
    except OptimizerError as e:
        if opts.debug:
            raise
        opts.err.print(error_line(str(e)), soft_wrap=True)
        return 2
    return 0


def _compile_one(opts: Any, recipe: Path, r: Any, run_dir: Path, no_cache: bool, no_bench: bool,
                 no_history: bool, mlflow_uri: str | None = None, workers: int = 1) -> None:
    """One recipe in this process: today's compile, its tables and its exit (typer.Exit through fail). workers:
    processes the pipeline's passes spread their independent evaluations over (ctx.map)."""
    from optimizer.cli.console import ConsoleEvents
    from optimizer.engine.pipeline import Pipeline
    from optimizer.report.build import write_report

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
    from optimizer.engine.memory_plan import run_plan

    for line in run_plan(r):  # what the run will take, before it starts (from file sizes: nothing is loaded)
        opts.out.print(line, highlight=False, markup=False)
    with ConsoleEvents(opts.out) as events:
        pipeline = Pipeline(r, run_dir, events, use_cache=not no_cache, measure=not no_bench, debug=debug,
                            workers=workers)
        pipeline.on_stage_done.append(write_progress)
        interrupted = False
        try:
            records = pipeline.execute()
        except KeyboardInterrupt:
            interrupted, records = True, pipeline.records
    _finish(opts, recipe, r, records, run_dir, time.perf_counter() - start, no_history, write_errors, interrupted,
            mlflow_uri)


def _finish(opts: Any, recipe: Path, r: Any, records: list[Any], run_dir: Path, wall: float, no_history: bool,
            write_errors: list[str], interrupted: bool, mlflow_uri: str | None = None) -> None:
    """The driver's part of a compile: the report built and saved, the history recorded, the tables shown, and
    the exit code (typer.Exit through fail) for failures."""
    from optimizer.cli.show import show_report, source_failure
    from optimizer.report.build import build_report, save_report
    from optimizer.report.history import record

    report = build_report(r, records, run_dir, wall) if records else None
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
    # Stage 0 failed: nothing else ran, and the run is the one error line below, not tables of "not run".
    failure = source_failure(report) if report else None
    if report and failure is None:
        show_report(report, run_dir, opts)
    elif failure is not None and opts.debug and (trace := records[0].traceback):
        opts.err.print(f"{records[0].name}:\n{trace}", highlight=False)
    mlflow_error: str | None = None
    if report and mlflow_uri:  # after the tables: a slow store delays nothing the user needs
        from optimizer.report.mlflow_log import log_run

        try:
            opts.out.print(f"mlflow: run {log_run(report, run_dir, mlflow_uri)} at {mlflow_uri}", highlight=False)
        except OptimizerError as e:
            mlflow_error = str(e)
    if mlflow_error:
        opts.err.print(warning_line(f"not logged to MLflow: {mlflow_error}"), soft_wrap=True)
    if history_error:
        opts.err.print(warning_line(f"run not recorded in the run history: {history_error}"), soft_wrap=True)
    if write_errors and not save_error:
        opts.err.print(warning_line(f"during the run: {write_errors[0]} (the final report was written)"),
                       soft_wrap=True)
    if interrupted:
        fail(opts, "interrupted; finished stages are kept and a re-run resumes from them", 130)
    if save_error:
        fail(opts, f"{recipe}: {failure}; and {save_error}" if failure else save_error, 1)
    if report and failure:
        if report.stages[0].error_kind == "input":  # a usage error: the file and field, as validate
            fail(opts, f"{recipe}: {report.stages[0].reason}", 2)
        fail(opts, f"{recipe}: {failure} (report: {run_dir / 'report.json'})", 1)
    if report and report.failed_stages:
        fail(opts, f"failed stages: {', '.join(report.failed_stages)} (see the table above)", 1)


def _compile_pooled(opts: Any, loaded: dict[Path, Any], run_dirs: dict[Path, Path], workers: int, backend: str,
                    address: str | None, no_cache: bool, no_bench: bool, no_history: bool,
                    mlflow_uri: str | None = None) -> tuple[list[int], bool]:
    """The recipes on workers (a local process pool, or Ray): a line per stage as they go, then, from the
    driver alone, each recipe's report, history entry and tables in the order given. The exit code of each, and
    whether the run was interrupted."""
    from optimizer.cli.console import STATUS_STYLE
    from optimizer.engine.jobs import Job

    debug = True if opts.debug else None
    jobs = [Job(path.resolve(), run_dirs[path].resolve(), not no_cache, not no_bench, debug) for path in loaded]
    names = {job.recipe_path: loaded[path].name for job, path in zip(jobs, loaded, strict=True)}

    def stage_line(recipe: str, index: int, stage: str, status: str, reason: str | None) -> None:
        style = STATUS_STYLE.get(status, "white")
        why = f": {reason}" if reason else ""
        opts.out.print(styled(f"{recipe}: {index:02d} {stage} ", (status, style), why), soft_wrap=True)

    def done_line(result: Any) -> None:
        what = "failed to run" if result.error else "interrupted" if result.interrupted else "done"
        opts.out.print(f"{names[result.job.recipe_path]}: {what} ({result.wall_seconds:.1f} s)", highlight=False)

    start = time.perf_counter()
    recipe_of = {job.recipe_path: loaded[path] for job, path in zip(jobs, loaded, strict=True)}

    def progress_report(job: Any, records: list[Any]) -> None:
        """The recipe's report after each of its stages, marked incomplete, as a serial compile writes it (the
        driver writes it: workers write no report)."""
        from optimizer.report.build import write_report

        with contextlib.suppress(OptimizerError):  # the final report is written all the same, and says what failed
            write_report(recipe_of[job.recipe_path], records, job.run_dir, time.perf_counter() - start,
                         in_progress=True)

    signal.signal(signal.SIGTERM, _sigterm)
    interrupted = False
    from optimizer.engine.pool import Interrupted

    try:
        if backend == "ray":
            from optimizer.engine.ray_backend import run_ray

            results = run_ray(jobs, address, num_cpus=1, local_cpus=max(workers, 2), on_done=done_line)
        else:
            from optimizer.engine.pool import run_pool

            results = run_pool(jobs, workers, stage_line, done_line, progress_report)
    except Interrupted as e:
        opts.err.print("interrupted: the workers stopped; the reports of what they finished follow", highlight=False)
        interrupted, results = True, e.results
    codes = []
    for job, path in zip(jobs, loaded, strict=True):
        result = next(x for x in results if x.job.recipe_path == job.recipe_path)
        if result.error:
            opts.err.print(error_line(f"{path}: {result.error}"), soft_wrap=True)
            codes.append(result.error_code)
            continue
        if result.interrupted and not result.records:
            opts.err.print(f"{path}: interrupted before its first stage finished", highlight=False, soft_wrap=True)
            codes.append(130)
            continue
        codes.append(_exit_code(opts, lambda p=path, x=result: _finish(  # type: ignore[misc]
            opts, p, loaded[p], x.records, run_dirs[p], x.wall_seconds, no_history, [], x.interrupted, mlflow_uri)))
    return codes, interrupted


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
    from rich.text import Text

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
            Text("available", "green") if reason is None else Text(f"unavailable: {reason}", "yellow"),
        )
    options(ctx).out.print(table)
