"""The command line's shape: sub-apps without an import circle, options through the context, a fast start."""

from __future__ import annotations

import signal
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from conftest import TESTS

from optimizer.cli.app import app, main

ROOT = TESTS.parent
HEAVY = ("torch", "onnx", "onnxruntime", "transformers", "tensorrt", "polygraphy")
# Runs the CLI in a fresh interpreter and, at exit, names the heavy libraries it imported.
PROBE = f"""
import atexit, sys
atexit.register(lambda: print("HEAVY:" + ",".join(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr))
from optimizer.cli.app import main
main(sys.argv[1:])
"""
COMMANDS = ["validate", "compile", "report", "passes", "runs", "diff", "export", "verify", "bench", "select", "compare"]


def heavy_imports(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("HEAVY:")][-1]
    return [m for m in line.removeprefix("HEAVY:").split(",") if m]


@pytest.mark.parametrize(
    "args",
    [["--help"], *([cmd, "--help"] for cmd in COMMANDS), ["validate", "recipes/minilm-cpu.yaml"]],
    ids=lambda a: " ".join(a),
)
def test_light_commands_import_no_heavy_library(args: list[str]) -> None:
    assert heavy_imports(*args) == []


def test_passes_imports_no_heavy_library() -> None:
    """The pass list says which passes can run here; on a CPU build of torch that is known without importing
    it (optimizer/runtime/gpu reads torch's version.py)."""
    assert heavy_imports("passes") == []


def test_sub_apps_import_no_circle() -> None:
    """The command modules never import the root app (they used to: app <-> runs)."""
    code = "import sys, optimizer.cli.compile, optimizer.cli.runs; print('optimizer.cli.app' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.stdout.strip() == "False", proc.stderr


def test_commands_are_all_on_the_root_in_their_order() -> None:
    assert list(typer.main.get_group(app).commands) == COMMANDS


def test_no_module_level_state() -> None:
    from rich.console import Console

    import optimizer.cli.app as app_module
    import optimizer.cli.compile as compile_module
    import optimizer.cli.runs as runs_module

    for module in (app_module, compile_module, runs_module):
        assert "STATE" not in vars(module)
        assert not [name for name, value in vars(module).items() if isinstance(value, Console)], module.__name__


class FakePipeline:
    """Stands in for the engine: records how compile built it; execute raises `error` when given."""

    made: list[dict[str, Any]] = []
    error: BaseException | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        FakePipeline.made.append(kwargs)
        self.on_stage_done: list[Any] = []
        self.records: list[Any] = []

    def execute(self) -> list[Any]:
        if FakePipeline.error is not None:
            raise FakePipeline.error
        return []


@pytest.fixture
def fake_pipeline(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakePipeline]]:
    module = types.ModuleType("optimizer.engine.pipeline")
    module.Pipeline = FakePipeline  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "optimizer.engine.pipeline", module)
    FakePipeline.made, FakePipeline.error = [], None
    handler = signal.getsignal(signal.SIGTERM)
    yield FakePipeline
    signal.signal(signal.SIGTERM, handler)  # compile installs its own


def compile_exit(*args: str) -> int:
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    return int(exited.value.code or 0)


@pytest.mark.parametrize(("flags", "debug"), [(["--debug"], True), ([], None)])
def test_debug_reaches_the_pipeline(
    fake_pipeline: type[FakePipeline], tiny_recipe: Path, tmp_path: Path, flags: list[str], debug: bool | None
) -> None:
    """--debug: True; without it None, so the pipeline's own default (OPTIMIZER_DEBUG) applies."""
    assert compile_exit(*flags, "compile", str(tiny_recipe), "--out", str(tmp_path / "run"), "--no-history") == 0
    assert [made["debug"] for made in fake_pipeline.made] == [debug]


def test_debug_raises_our_errors_with_the_traceback(
    fake_pipeline: type[FakePipeline], tiny_recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_pipeline.error = KeyError("bug")
    args = ["compile", str(tiny_recipe), "--out", str(tmp_path / "run"), "--no-history"]
    with pytest.raises(KeyError):
        main(["--debug", *args])
    assert compile_exit(*args) == 1
    assert "KeyError: 'bug' (run with --debug for the traceback)" in capsys.readouterr().err


def test_history_option_reaches_the_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    history = tmp_path / "history.sqlite"
    assert compile_exit("--history", str(history), "runs") == 0
    assert str(history) in "".join(capsys.readouterr().out.split())  # the table's title, wrapped to its width
