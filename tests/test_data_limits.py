"""Issue 47, class 5 (part): a FIFO, a device or a socket named as a model or a data_file is refused in one line
(exit 2) instead of hanging the command on an open that never returns (core.files.not_regular, at load)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from conftest import TESTS, mlp_recipe


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    env.pop("OPTIMIZER_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "optimizer.cli.app", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=90)


def test_fifo_as_model_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "m.onnx"
    os.mkfifo(fifo)
    got = _run("compile", "--model", str(fifo), "--out", str(tmp_path / "run"), "--no-history", cwd=tmp_path)
    assert got.returncode == 2, got.stderr
    assert str(fifo) in got.stderr and "not a regular file" in got.stderr
    assert len(got.stderr.strip().splitlines()) == 1, got.stderr


def test_fifo_as_data_file_is_refused_by_validate(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "data.npz")
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(mlp_recipe(data_file="data.npz"), sort_keys=False))
    got = _run("validate", str(tmp_path / "r.yaml"), cwd=tmp_path)
    assert got.returncode == 2, got.stderr
    assert "data_file" in got.stderr and "not a regular file" in got.stderr


def test_fifo_as_onnx_model_path_is_refused_by_validate(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "m.onnx")
    data = mlp_recipe(model={"source": "onnx", "path": "m.onnx"})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    got = _run("validate", str(tmp_path / "r.yaml"), cwd=tmp_path)
    assert got.returncode == 2, got.stderr
    assert "model.path" in got.stderr and "not a regular file" in got.stderr
