"""Adversarial cases of issue 28 (paths); see tests/corpus/adversarial.py.

R3.3: a handed-over run folder with links planted at the names compile writes (its lock, an atomic write's temp
name, the write probe, a leftover build folder), and an --out that is a folder of the user's files: held when
nothing outside the run folder is written or deleted and the refusal is our one error line (exit 2).
R3.4: paths, folders and error messages with rich markup in them, through the real command line: held when the
command does what it would for a plain name (exit code, tables, history row) and prints the text as it is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from .adversarial import Shared

PATHS = "R3.3 paths not meant"
MARKUP = "R3.4 user text as markup"


def _cli(*args: str, path: list[str] | None = None) -> tuple[int, str]:
    """`optimizer ARGS` as a user runs it (a process of its own, importing what this one can, and `path`): its
    exit code and everything it printed."""
    from optimizer.runtime.childpath import child_env

    proc = subprocess.run([sys.executable, "-m", "optimizer", *args], capture_output=True, text=True, timeout=600,
                          env=child_env([*(path or []), *sys.path]))
    return proc.returncode, proc.stdout + proc.stderr


def _victim(work: Path) -> Path:
    victim = work / "victim.txt"
    victim.write_text("precious")
    return victim


def _intact(victim: Path) -> bool:
    return victim.read_text() == "precious"


def _one_error(code: int, text: str, names: str) -> bool | str:
    lines = [line for line in text.splitlines() if line.strip()]
    if code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and names in lines[0]:
        return True
    return f"exit {code}: {text[-300:]!r}"


def _handed_over(r: Shared, name: str) -> Path:
    """A copy of the compiled run folder (links kept as links)."""
    copy = r.work / name
    shutil.copytree(r.run, copy, symlinks=True)
    return copy


def path_cases(r: Shared, recipe: Path, history: Path) -> None:
    from optimizer.engine.rundir import RunDir, write_text

    def lock_link() -> bool | str:
        run, victim = _handed_over(r, "lock-link"), _victim(r.work)
        (run / ".lock").unlink(missing_ok=True)
        (run / ".lock").symlink_to(victim)
        code, text = _cli("--history", str(history), "compile", str(recipe), "--out", str(run), "--no-bench")
        return _one_error(code, text, str(run / ".lock")) if _intact(victim) else "the link's target was written"

    def temp_link() -> bool | str:
        run, victim = _handed_over(r, "temp-link"), _victim(r.work)
        (run / f".report.json.tmp-{os.getpid()}").symlink_to(victim)
        write_text(run / "report.json", "{}")
        return _intact(victim) or "the temp name's link was followed"

    def probe_link() -> bool | str:
        run, victim = _handed_over(r, "probe-link"), _victim(r.work)
        (run / f".write-probe-{os.getpid()}").symlink_to(victim)
        rd = RunDir(run)
        rd.prepare()
        rd.release()
        return _intact(victim) or "the write probe's link was followed"

    def building_link() -> bool | str:
        run, mine = _handed_over(r, "building-link"), r.work / "mine-building"
        mine.mkdir()
        (mine / "thesis.tex").write_text("chapter 1")
        (run / ".building-01-export").symlink_to(mine, target_is_directory=True)
        rd = RunDir(run)
        rd.prepare()
        rd.building_dir(1, "export")
        rd.release()
        return (mine / "thesis.tex").is_file() or "the linked folder was emptied"

    def reference_link() -> bool | str:
        from optimizer.engine.pipeline import Pipeline
        from optimizer.recipe.loading import load_recipe

        run, victim = _handed_over(r, "reference-link"), _victim(r.work)
        (run / "00-source" / "reference.npz").unlink()  # stage 0 measures again and writes it anew
        (run / "00-source" / ".reference.tmp.npz").symlink_to(victim)
        Pipeline(load_recipe(recipe), run).execute()
        return _intact(victim) or "the reference's temp link was followed"

    def users_folder(model: bool) -> Callable[[], bool | str]:
        def go() -> bool | str:
            mine = r.work / f"mine-{'model' if model else 'recipe'}"
            (mine / "01-export").mkdir(parents=True)
            (mine / "01-export" / "thesis.tex").write_text("chapter 1")
            (mine / "report.md").write_text("my report")
            before = sorted(str(p) for p in mine.rglob("*"))
            what = ["--model", "tiny_models:mlp"] if model else [str(recipe)]
            code, text = _cli("--history", str(history), "compile", *what, "--out", str(mine), "--no-bench")
            if sorted(str(p) for p in mine.rglob("*")) != before or (mine / "report.md").read_text() != "my report":
                return "the user's folder was changed"
            return _one_error(code, text, str(mine))

        return go

    r.out.add(PATHS, ".lock a link to a file outside", lock_link)
    r.out.add(PATHS, "atomic write's temp name a link", temp_link)
    r.out.add(PATHS, "write probe's name a link", probe_link)
    r.out.add(PATHS, "build leftover a link to a folder outside", building_link)
    r.out.add(PATHS, "stage 0 reference's temp name a link", reference_link)
    r.out.add(PATHS, "compile --out a folder of the user's files", users_folder(False))
    r.out.add(PATHS, "compile --model --out a folder of the user's files", users_folder(True))


def markup_cases(r: Shared, history: Path) -> None:
    def recipe_at(path: Path, **changes: object) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump({**r.base, **changes}, sort_keys=False))
        return path

    def validate_ok() -> bool | str:
        path = recipe_at(r.work / "odd[/x]" / "r.yaml")
        code, text = _cli("validate", str(path))
        return True if code == 0 and f"ok {path}" in text else f"exit {code}: {text[-300:]!r}"

    def error_path() -> bool | str:
        path = recipe_at(r.work / "models[v2]" / "r.yaml", passes=[{"type": "nope"}])
        return _one_error(*_cli("validate", str(path)), str(path))

    def compile_out() -> bool | str:
        out = r.work / "runs" / "r[/x]"
        code, text = _cli("--history", str(history), "compile", str(recipe_at(r.work / "plain.yaml")), "--out",
                          str(out), "--no-bench")
        if code != 0 or f"report: {out / 'report.json'}" not in text:
            return f"compile: exit {code}: {text[-300:]!r}"
        code, text = _cli("--history", str(history), "runs")
        return True if code == 0 and str(out) in text else f"runs: exit {code}: {text[-300:]!r}"

    def factory_error() -> bool | str:
        (r.work / "r3_paths_factory.py").write_text(
            "def broken():\n    raise OSError('cannot read the weights at [/data]/w.bin [bold]')\n")
        run = r.work / "factory-run"
        recipe = recipe_at(r.work / "factory.yaml", model={"source": "factory", "target": "r3_paths_factory:broken"})
        code, text = _cli("--history", str(history), "compile", str(recipe), "--out", str(run), "--no-bench",
                          path=[str(r.work)])
        if code != 1 or "00 source" not in text or "at [/data]/w.bin [bold]" not in text:
            return f"compile: exit {code}: {text[-300:]!r}"
        if not (run / "report.json").is_file():
            return "no report.json"
        code, text = _cli("--history", str(history), "runs")
        return True if code == 0 and str(run) in text else f"runs: exit {code}: {text[-300:]!r}"

    r.out.add(MARKUP, "validate odd[/x]/r.yaml", validate_ok)
    r.out.add(MARKUP, "error naming models[v2]/r.yaml", error_path)
    r.out.add(MARKUP, "compile --out runs/r[/x], then runs", compile_out)
    r.out.add(MARKUP, "factory error mentioning [/data]", factory_error)


def add_cases(r: Shared) -> None:
    r.work.mkdir(parents=True, exist_ok=True)
    recipe = r.work / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(r.base, sort_keys=False))
    history = r.work / "history.sqlite"  # never the user's
    path_cases(r, recipe, history)
    markup_cases(r, history)
