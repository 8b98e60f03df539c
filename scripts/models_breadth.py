"""Compile a small random-weight model of each family users bring with `optimizer compile --model`, and print the
table (see tests/corpus/breadth.py).

python scripts/models_breadth.py [--out DIR] [--cases bert,gpt2] [--sizes smallest|small] [--bench] [--markdown]

Exits 1 when an outcome differs from breadth.EXPECTED (a crash, a case that compiled failing, a refusal that
now compiles), else 0. Models, runs and results.json land under --out (default: a new temporary folder, kept and named
at the end).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))  # the corpus package (tests/corpus)

from corpus.breadth import EXPECTED, HEADER, SIZES, TIMEOUT_S, Result, markdown, rows, select, unexpected  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="folder for the models and the runs (default: a new temporary folder)")
    ap.add_argument("--cases", help=f"comma-separated, of: {', '.join(EXPECTED)} (default: all)")
    ap.add_argument("--sizes", choices=SIZES, default="smallest", help="model dimensions (default: smallest)")
    ap.add_argument("--bench", action="store_true", help="also time every stage (default: --no-bench, build only)")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per compile (default: %(default)s)")
    ap.add_argument("--debug", action="store_true", help="compile with --debug: a bug of ours shows its traceback")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown (the README's)")
    args = ap.parse_args()
    try:
        cases = select(args.cases)
    except ValueError as e:
        ap.error(str(e))
    out = (args.out or Path(tempfile.mkdtemp(prefix="models-breadth-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    err = Console(stderr=True)

    def progress(r: Result) -> None:
        mark = "" if r.as_expected else f" [red](expected {r.expected})[/red]"
        err.print(f"{r.case}: {r.outcome}{mark} in {r.seconds:.0f} s (built in {r.build_seconds:.0f} s)",
                  highlight=False)

    from corpus.breadth import run_cases

    start = time.perf_counter()
    results = run_cases(cases, out, size=args.sizes, bench=args.bench, timeout=args.timeout, debug=args.debug,
                        progress=progress)
    total = time.perf_counter() - start
    (out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    if args.markdown:
        print(markdown(results))
    else:
        table = Table(title=f"compile --model, {args.sizes} sizes, {'benchmarked' if args.bench else '--no-bench'}")
        for h in HEADER:
            table.add_column(h, overflow="fold")
        for r, row in zip(results, rows(results), strict=True):
            table.add_row(*row, style=None if r.as_expected else "red")
        console = Console()
        if not console.is_terminal:  # a log or a pipe: the notes unwrapped rather than folded into 80 columns
            console = Console(width=240)
        console.print(table)
    err.print(f"{len(results)} cases in {total:.0f} s; models and runs in {out}", highlight=False)
    bad = unexpected(results)
    for r in bad:
        err.print(f"[red]{r.case}: {r.outcome}, expected {r.expected}[/red]: {r.message}\n  {r.command}",
                  highlight=False)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
