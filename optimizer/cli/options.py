"""The root command's options, handed to every command through typer's Context (ctx.obj) instead of globals."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console


def stdout_console() -> Console:
    # Piped output (CI logs, files) gets a width that fits the stage table instead of rich's default 80.
    return Console() if Console().is_terminal else Console(width=220)


def stderr_console() -> Console:
    return Console(stderr=True) if Console(stderr=True).is_terminal else Console(stderr=True, width=1000)


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
    opts.err.print(f"[red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)
