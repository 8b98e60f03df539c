"""A/A test of `optimizer diff`: the main job compiled twice with --no-cache and diffed must say "within noise"
for every stage (exit 0 with --fail-on-regression 5); then a third compile with one pass deliberately slowed
(`fuse` without its attention rule: the rule that buys most of its speed) must be caught as a regression (exit 3).

Each compile runs in its own process, as a user's would. Writes everything under --out (default runs/aa).

    python benchmarks/aa_diff.py [--out runs/aa] [--recipe recipes/minilm-cpu.yaml] [--reuse]

Question: whether `optimizer diff` reads two compiles of one job as within noise and catches a pass slowed on purpose.
Written up in: docs/workflows.md#diff-history-bundles.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import yaml


def optimizer(*args: str, history: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "optimizer.cli.app", "--history", str(history), *args]
    print("$ optimizer " + " ".join(args[:4]) + (" ..." if len(args) > 4 else ""), flush=True)
    return subprocess.run(cmd, text=True, capture_output=True, env={**os.environ, "COLUMNS": "200"})


def compile_run(recipe: Path, out: Path, history: Path, reuse: bool) -> None:
    if reuse and (out / "report.json").is_file():
        return
    proc = optimizer("compile", str(recipe), "--out", str(out), "--no-cache", history=history)
    if proc.returncode != 0:
        sys.exit(f"compile of {recipe} into {out} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")


def slowed_recipe(recipe: Path, folder: Path) -> Path:
    """The same recipe with fuse's attention rule off, without the hybrid search and the batch sweep (they are
    not what this checks, and take minutes). Text paths made absolute, so it runs from another folder."""
    from passes.fuse import RULE_NAMES

    data = yaml.safe_load(recipe.read_text())
    if data.get("text", {}).get("file"):
        data["text"]["file"] = str((recipe.parent / data["text"]["file"]).resolve())
    data["passes"] = [p for p in data["passes"] if p.get("name") != "hybrid"]
    for p in data["passes"]:
        if p["type"] == "fuse":
            p["config"] = {**p.get("config", {}), "rules": [r for r in RULE_NAMES if r != "attention"]}
    data.pop("batch_sweep", None)
    path = folder / "slowed.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/aa"))
    ap.add_argument("--recipe", type=Path, default=Path("recipes/minilm-cpu.yaml"))
    ap.add_argument("--reuse", action="store_true", help="keep runs already in --out (re-diff only)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    history = args.out / "history.sqlite"
    a, b, c = args.out / "A", args.out / "B", args.out / "C-slowed"
    for run in (a, b):
        compile_run(args.recipe, run, history, args.reuse)
    compile_run(slowed_recipe(args.recipe, args.out), c, history, args.reuse)

    same = optimizer("diff", str(a), str(b), "--format", "md", "--fail-on-regression", "5", history=history)
    print(same.stdout, same.stderr, f"exit {same.returncode}\n", sep="\n")
    slow = optimizer("diff", str(a), str(c), "--format", "md", "--fail-on-regression", "5", history=history)
    print(slow.stdout, slow.stderr, f"exit {slow.returncode}\n", sep="\n")
    ok = same.returncode == 0 and slow.returncode == 3 and "fuse on" in slow.stderr
    print("A/A within noise, slowed pass caught:" if ok else "FAILED:", same.returncode, slow.returncode)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
