"""`optimizer compile` refuses options it would ignore or cannot honour, with one line and exit 2, before any work:
nothing built, no run folder, no history entry."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import write_recipe
from test_workers import compile_code, small

from optimizer.runtime.gpu import cuda_reason


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    return write_recipe(tmp_path, small("o-one"), "one.yaml")


def _err_line(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_device_without_model_is_refused(recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = compile_code("compile", "--device", "cuda", str(recipe), "--out", str(tmp_path / "run"), "--no-history")
    assert code == 2 and "--device is for --model" in _err_line(capsys)
    assert not (tmp_path / "run").exists()


def test_address_without_ray_is_refused(recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = compile_code("compile", str(recipe), "--address", "10.0.0.1:6379", "--out", str(tmp_path / "run"),
                        "--no-history")
    assert code == 2 and "--address is for --backend ray" in _err_line(capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("uri, message", [
    ("http://127.0.0.1:9", "Max retries exceeded"),  # nothing listens on port 9: refused at once
    ("bogus://x", "unknown scheme 'bogus'"),
])
def test_mlflow_store_checked_before_compiling(uri: str, message: str, recipe: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("mlflow")
    history = tmp_path / "history.sqlite"
    start = time.perf_counter()
    code = compile_code("--history", str(history), "compile", str(recipe), "--out", str(tmp_path / "run"),
                        "--mlflow", uri)
    seconds = time.perf_counter() - start
    line = _err_line(capsys)
    assert code == 2 and line.startswith(f"error: --mlflow {uri}: ") and message in line
    assert seconds < 20, seconds  # was: the whole compile, then ~4 min of MLflow retries, then exit 0
    assert not (tmp_path / "run").exists() and not history.exists()


@pytest.mark.skipif(cuda_reason() is None, reason="this machine has a CUDA device: the target can run here")
def test_model_for_cuda_on_a_machine_without_one_builds_nothing(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    history = tmp_path / "history.sqlite"
    code = compile_code("--history", str(history), "compile", "--model", "tiny_models:mlp", "--device", "cuda",
                        "--out", str(tmp_path / "run"))
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.strip() == f"error: --model tiny_models:mlp --device cuda: {cuda_reason()} (--no-bench " \
                                   "builds without measuring)"
    assert captured.out == ""  # no empty scenario tables
    assert not (tmp_path / "run").exists() and not history.exists()  # no recipe, no report, no history entry


@pytest.mark.slow
def test_tables_print_before_mlflow_logging(recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A slow store delays nothing the user needs: the tables and the report line come first."""
    pytest.importorskip("mlflow")
    uri = (tmp_path / "mlruns").as_uri()
    code = compile_code("compile", str(recipe), "--out", str(tmp_path / "run"), "--no-bench", "--no-history",
                        "--mlflow", uri)
    out = capsys.readouterr().out
    assert code == 0 and "mlflow: run " in out
    assert out.index("report: ") < out.index("mlflow: run ")
