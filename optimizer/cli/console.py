"""Terminal output: live progress while stages run, and the per-scenario stage table at the end.

Nothing here is markup: stage names, reasons and table cells are plain text, our colours are Text styles (see
options.MARKUP), so a reason that mentions "[/data]" is printed as it is.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from optimizer.core.stage import StageRecord
from optimizer.report.schema import RunReport
from optimizer.report.tables import columns, scenario_summary, scenario_title, stage_rows

STATUS_STYLE = {
    "ran": "green", "cached": "cyan", "unchanged": "blue", "skipped": "yellow", "failed": "red", "interrupted": "red",
}


class WhatColumn(ProgressColumn):
    """The task's `what` field: a Text keeps its style, anything else is plain text (never markup)."""

    def render(self, task: Task) -> Text:
        what = task.fields.get("what", "")
        return what if isinstance(what, Text) else Text(str(what))


class ConsoleEvents:
    """Pipeline events -> a rich progress display: one line per stage, with a bar while it is timed."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            WhatColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.tasks: dict[str, TaskID] = {}

    def __enter__(self) -> ConsoleEvents:
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def stage_start(self, rec: StageRecord) -> None:
        self.tasks[rec.name] = self.progress.add_task(f"{rec.index:02d} {rec.name}", total=None, what="starting")

    def stage_progress(self, rec: StageRecord, what: str, done: int, total: int) -> None:
        task = self.tasks.get(rec.name)
        if task is not None:
            self.progress.update(task, what=what, completed=done, total=total or None)

    def stage_end(self, rec: StageRecord) -> None:
        task = self.tasks.get(rec.name)
        if task is None:
            return
        style = STATUS_STYLE.get(rec.status, "white")
        text = rec.status + (f": {rec.reason}" if rec.reason else "")
        self.progress.update(task, what=Text(text, style), completed=1, total=1)
        if not self.console.is_terminal:  # a log file or a pipe sees no live display: one line a stage, as it ends
            self.console.print(Text(f"{rec.index:02d} {rec.name}: {text}"), soft_wrap=True)


def stage_tables(report: RunReport) -> list[Table]:
    tables = []
    for scen in report.scenarios:
        table = Table(
            title=f"{report.recipe.name} | scenario {scenario_title(report, scen)}",
            title_justify="left",
            header_style="bold",
        )
        cols = columns(report)
        for key, header in cols:
            table.add_column(
                header, justify="left" if key in ("stage", "parent", "status") else "right", overflow="fold"
            )
        for row in stage_rows(report, scen.name):
            cells: list[str | Text] = [row[k] for k, _ in cols]
            cells[2] = Text(str(cells[2]), STATUS_STYLE.get(row["status"], ""))
            table.add_row(*cells)
        tables.append(table)
    return tables


def summary_table(report: RunReport) -> Table | None:
    if len(report.scenarios) < 2:
        return None
    head, rows = scenario_summary(report)
    table = Table(
        title="scenario x stage: speedup vs stage 0 (P50 in the stage's own session)",
        title_justify="left",
        header_style="bold",
    )
    for h in head:
        table.add_column(h, justify="left" if h == "stage" else "right")
    for row in rows:
        table.add_row(*row)
    return table


def scenario_best_table(report: RunReport) -> Table | None:
    """Each scenario's fastest stage within the budget, stage 0 included ("keep PyTorch")."""
    best = report.best
    if best is None or not best.per_scenario:
        return None
    table = Table(title="best per scenario (fastest within the accuracy budget, stage 0 included)",
                  title_justify="left", header_style="bold")
    for h, justify in (("scenario", "left"), ("stage", "left"), ("vs stage 0 (95% CI)", "right")):
        table.add_column(h, justify=justify)  # type: ignore[arg-type]
    for scen, w in best.per_scenario.items():
        name = f"{w.stage} (keep stage 0)" if w.keep_source else w.stage
        table.add_row(scen, name, f"{w.ratio:.2f}x ({w.low:.2f}-{w.high:.2f})")
    return table
