"""The root command's options, handed to every command through typer's Context (ctx.obj) instead of globals."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.segment import Segment
from rich.text import Text

# Our consoles never parse markup: paths, names, recipe values and error messages carry brackets ("runs/r[/x]",
# "models[v2]") that rich would take for tags (and crash on, or drop). What we style ourselves is a Text with
# style spans (styled() below, or Text cells in tables), so nothing the user wrote is ever read as markup.
MARKUP = False

# What a terminal acts on instead of showing: C0 controls but tab and newline (ESC starts every sequence that
# clears, moves, recolours or retitles), DEL, C1 (0x9b is a one-byte CSI) and the bidi overrides that reorder text.
_UNSHOWABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def terminal_text(text: str) -> str:
    """`text` as a terminal shows it and never obeys it: each control character becomes its escape (ESC ->
    \\x1b), the rest is unchanged. The one escaping of the console boundary: every line our consoles write goes
    through it (TerminalConsole), and so does what a command prints plainly (echo)."""
    return _UNSHOWABLE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


class TerminalConsole(Console):
    """A rich Console whose text is escaped at the last step, after layout: names, reasons, table cells and
    titles from models, bundles and run folders reach the terminal as text; our own styles (rendered by rich
    around the escaped text) and the progress display's cursor moves (control segments) are kept."""

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return super()._render_buffer(
            seg if seg.control else Segment(terminal_text(seg.text), seg.style) for seg in buffer
        )


def echo(text: str) -> None:
    """print() for what a command writes plainly to stdout (markdown, JSON), escaped like the consoles' text."""
    print(terminal_text(text))


def stdout_console(**kwargs: Any) -> Console:
    # Piped output (CI logs, files) gets a width that fits the stage table instead of rich's default 80.
    if "file" in kwargs or Console().is_terminal:
        return TerminalConsole(markup=MARKUP, **kwargs)
    return TerminalConsole(width=220, markup=MARKUP, **kwargs)


def stderr_console() -> Console:
    if Console(stderr=True).is_terminal:
        return TerminalConsole(stderr=True, markup=MARKUP)
    return TerminalConsole(stderr=True, width=1000, markup=MARKUP)


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
    said: bool = False  # a command printed its own error line (fail): main adds none


def options(ctx: typer.Context) -> CliOptions:
    """This invocation's options (a fresh default set when a test invokes a command without main)."""
    return ctx.find_root().ensure_object(CliOptions)


def fail(opts: CliOptions, message: str, code: int) -> NoReturn:
    opts.err.print(error_line(message), soft_wrap=True)
    opts.said = True
    raise typer.Exit(code)
