"""How long the command line takes, process start to exit: `optimizer --help` and `optimizer validate RECIPE`.

Each command runs --runs times in a fresh process; prints median, min and max per command. --prefix is the
command that starts the CLI, so an older checkout can be measured the same way:

    python benchmarks/bench_cli_start.py                      # this tree, through `python -m optimizer`
    cd /tmp/base && PYTHONPATH=/tmp/base python /work/main/benchmarks/bench_cli_start.py \\
        --recipe /tmp/base/recipes/minilm-cpu.yaml --prefix "python -c 'from optimizer.cli import main; main()'"

(the commands run in the current folder, which `python -c` and `-m` put first on sys.path: run an older
checkout from its own folder.) The machine's load moves these numbers: compare runs made back to back.

Question: how long the command line takes from process start to exit (`--help`, `validate`).
Written up in: docs/architecture.md (start-up).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def time_once(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:  # a failing command is no start time: say why instead of timing the error path
        sys.exit(f"{shlex.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return elapsed


def measure(cmd: list[str], runs: int) -> list[float]:
    time_once(cmd)  # one unmeasured run, so every measured one finds the files in the page cache
    return [time_once(cmd) for _ in range(runs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7, help="measured runs per command (default 7)")
    ap.add_argument("--prefix", default=f"{shlex.quote(sys.executable)} -m optimizer",
                    help="command line that starts the CLI (default: this python -m optimizer)")
    ap.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "minilm-cpu.yaml", help="recipe to validate")
    args = ap.parse_args()
    prefix = shlex.split(args.prefix)
    commands = {"--help": [*prefix, "--help"], "validate": [*prefix, "validate", str(args.recipe)]}
    print(f"prefix: {args.prefix}  ({args.runs} runs each)")
    print(f"{'command':<10} {'median s':>9} {'min s':>7} {'max s':>7}")
    for name, cmd in commands.items():
        t = measure(cmd, args.runs)
        print(f"{name:<10} {statistics.median(t):>9.3f} {min(t):>7.3f} {max(t):>7.3f}")


if __name__ == "__main__":
    main()
