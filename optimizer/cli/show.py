"""What a person reads after a compile (and from `optimizer report`); imported by those commands when they run."""

from __future__ import annotations

from pathlib import Path

from optimizer.cli.console import scenario_best_table, stage_tables, summary_table
from optimizer.cli.options import CliOptions, styled
from optimizer.engine.rundir import RunDir
from optimizer.report.schema import RunReport
from optimizer.report.tables import tail_note


def source_failure(report: RunReport) -> str | None:
    """'stage 0 (source) failed: WHY; nothing after it ran' when stage 0 failed, else None: such a run has no
    reference, so every other stage is "not run" and its tables would say nothing but that."""
    source = report.stages[0] if report.stages else None
    if source is None or source.status != "failed":
        return None
    return f"stage 0 ({source.name}) failed: {source.reason or 'no reason recorded'}; nothing after it ran"


def show_report(report: RunReport, run_dir: Path, opts: CliOptions) -> None:
    """The stage tables, notes, findings; a run still going or killed says so first. A run whose stage 0 failed
    is one line: why, and where its report is."""
    out, err = opts.out, opts.err
    failure = source_failure(report)
    if failure is not None:
        if opts.debug and report.stages[0].traceback:
            err.print(f"{report.stages[0].name}:\n{report.stages[0].traceback}", highlight=False)
        head, _, rest = failure.partition(":")
        out.print(styled((head, "red"), f":{rest} (report: {run_dir / 'report.json'})"), soft_wrap=True)
        return
    if report.outcome == "incomplete":
        pending = [st.name for st in report.stages if st.status == "pending"]
        writer = RunDir(run_dir).writer_pid()
        state = f"still running (pid {writer})" if writer else "killed before it finished (no process holds it)"
        out.print(
            styled(("outcome: incomplete", "yellow"), f": the run was {state}; not reached: "
                   f"{', '.join(pending) or '-'}. Re-run the same compile to resume from the finished stages.")
        )
    for table in stage_tables(report):
        out.print(table)
    summary = summary_table(report)
    if summary is not None:
        out.print(summary)
    if opts.debug:
        for st in report.stages:
            if st.traceback:
                err.print(f"{st.name}:\n{st.traceback}", highlight=False)
    out.print(
        "vs parent: stage and parent timed interleaved in one session (~ = within noise); "
        "P50/P99 come from that same session, so compare stages through the ratios.", style="dim"
    )
    note = tail_note(report)
    if note:
        out.print(note, style="dim", highlight=False)
    for line in report.findings:
        out.print(styled(("!", "yellow"), f" {line}"))
    if report.best is not None and report.best.stage:
        out.print(styled(("best", "bold"), f": {report.best.why}"))
        table = scenario_best_table(report)
        if table is not None:
            out.print(table)
        if report.best.advice:
            out.print(styled(("per scenario", "bold"), f": {report.best.advice}; `optimizer export RUN --stage best "
                             "--scenario NAME` exports a scenario's winner"))
    run_id = report.history_id
    out.print(
        f"report: {run_dir / 'report.json'}, {run_dir / 'report.md'}, {run_dir / 'report.html'}  "
        f"(wall time {report.wall_seconds:.0f} s{f', run id {run_id}' if run_id else ''})"
    )
