"""Command line: the root `optimizer` command, its global options, and main() (the script's entry point).

The commands live in sub-apps whose commands are merged into this one (same command line as one flat app):
compile.py (validate, compile, report, passes) and runs.py (runs, diff, export, verify, bench, select). Neither
imports this module; global options reach them through typer's Context (ctx.obj, a CliOptions).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import typer

from optimizer.cli import compare as compare_cmds
from optimizer.cli import compile as compile_cmds
from optimizer.cli import runs as runs_cmds
from optimizer.cli.options import CliOptions, error_line
from optimizer.core.errors import OptimizerError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Model optimization compiler.")
app.add_typer(compile_cmds.app)
app.add_typer(runs_cmds.app)
app.add_typer(compare_cmds.app)


@app.callback()
def _root(
    ctx: typer.Context,
    debug: bool = typer.Option(
        False, "--debug", help="errors of our own code raise with their traceback, not as a failed stage"
    ),
    history: Path | None = typer.Option(None, "--history", help="run history database (default: user data dir)"),
) -> None:
    opts = ctx.ensure_object(CliOptions)
    opts.debug, opts.history = debug, history


def _sigterm(*_: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Run the command line (argv: the arguments after the program name; default sys.argv) and exit with its code.

    Errors become one line and an exit code: 2 for ours (OptimizerError: a bad recipe, a missing file), 1 for the
    unexpected, 130 for an interrupt; with --debug both kinds raise with their traceback.
    """
    from optimizer.core.quiet import silence_libraries

    silence_libraries()  # the libraries' progress lines are not ours to print (their errors still are)
    opts = CliOptions()  # the root callback fills it; created here so that the handlers below see --debug
    main_thread = threading.current_thread() is threading.main_thread()
    callers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main_thread else {}
    if main_thread:
        signal.signal(signal.SIGTERM, _sigterm)  # every command: SIGTERM is Ctrl-C (exit 130, "interrupted")
    try:
        _run_app(argv, opts)
    finally:
        # Called from Python (argv given: a script, a notebook, the tests), this is not the process's end: the
        # caller's handlers go back (an export ignores Ctrl-C once its bundle is in place, and every later child
        # of the caller would start with SIGINT ignored). As the program itself, they hold through its teardown.
        if argv is not None:
            for sig, handler in callers.items():
                if handler is not None:  # None: a handler not set from Python, which cannot be put back
                    signal.signal(sig, handler)


def _run_app(argv: list[str] | None, opts: CliOptions) -> None:
    """The command, and its outcome as the exit code (see main)."""
    try:
        rc = app(args=argv, standalone_mode=False, obj=opts)
        if rc == 130 and not opts.said:  # typer turned an interrupt no command caught into exit 130, silently
            opts.err.print(error_line("interrupted"))
        sys.exit(rc if isinstance(rc, int) else 0)
    except OptimizerError as e:
        if opts.debug:
            raise
        opts.err.print(error_line(str(e)), soft_wrap=True)
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        opts.err.print(error_line("interrupted"))
        sys.exit(130)
    except Exception as e:  # click usage errors and the unexpected: one line unless --debug
        if hasattr(e, "show") and isinstance(code := getattr(e, "exit_code", None), int):  # click's usage errors
            e.show()
            sys.exit(code)
        if opts.debug:
            raise
        opts.err.print(error_line(f"{type(e).__name__}: {e} (run with --debug for the traceback)"), soft_wrap=True)
        sys.exit(1)


if __name__ == "__main__":  # `python -m optimizer.cli.app`, as some scripts call it
    main()
