"""The root command's options, handed to every command through typer's Context (ctx.obj) instead of globals."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.text import Text

# Our consoles never parse markup: paths, names, recipe values and error messages carry brackets ("runs/r[/x]",
# "models[v2]") that rich would take for tags (and crash on, or drop). What we style ourselves is a Text with
# style spans (styled() below, or Text cells in tables), so nothing the user wrote is ever read as markup.
MARKUP = False


def stdout_console() -> Console:
    # Piped output (CI logs, files) gets a width that fits the stage table instead of rich's default 80.
    return Console(markup=MARKUP) if Console().is_terminal else Console(width=220, markup=MARKUP)


def stderr_console() -> Console:
    if Console(stderr=True).is_terminal:
        return Console(stderr=True, markup=MARKUP)
    return Console(stderr=True, width=1000, markup=MARKUP)


def styled(*parts: str | tuple[str, str]) -> Text:
    """A line of plain strings and (words, style) pairs: only our own words get a style, the rest prints as it
    is, e.g. styled(("error:", "red"), f" {message}")."""
    return Text.assemble(*parts)


def error_line(message: str) -> Text:
    return styled(("error:", "red"), f" {message}")


def warning_line(message: str) -> Text:
    return styled(("warning:", "yellow"), f" {message}")


@dataclass
class CliOptions:
    """main() creates one per invocation and the root callback fills it from the parsed command line, so that
    main's error handling sees --debug too."""

    debug: bool = False  # our own code's errors raise with their traceback instead of becoming a failed stage
    history: Path | None = None  # run history database; None: the user data dir
    out: Console = field(default_factory=stdout_console)
    err: Console = field(default_factory=stderr_console)


def options(ctx: typer.Context) -> CliOptions:
    """This invocation's options (a fresh default set when a test invokes a command without main)."""
    return ctx.find_root().ensure_object(CliOptions)


def fail(opts: CliOptions, message: str, code: int) -> NoReturn:
    opts.err.print(error_line(message), soft_wrap=True)
    raise typer.Exit(code)
