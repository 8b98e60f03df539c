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


# ---- the rest of class 5, and class 9's data_file dtype: a data_file's arrays are checked against what the recipe
# declares for them (shape under every scenario, dtype, at least one sample, finite values) before anything runs;
# an hf_config's sizes are counts of at least 1 and generated ids stay inside its vocabulary.


def _compile_with_data(tmp_path: Path, array: object,
                       scenarios: list[dict] | None = None) -> subprocess.CompletedProcess[str]:
    import numpy as np

    np.savez(tmp_path / "data.npz", x=array)
    data = mlp_recipe(data_file="data.npz")
    if scenarios is not None:
        data["scenarios"] = scenarios
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return _run("compile", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "run"), "--no-history", cwd=tmp_path)


def _one_line_naming_data_file(got: subprocess.CompletedProcess[str], *words: str) -> None:
    assert got.returncode == 2, (got.returncode, got.stdout[-2000:], got.stderr[-2000:])
    lines = [ln for ln in got.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, got.stderr
    assert "data_file" in lines[0], lines[0]
    for w in words:
        assert w in lines[0], lines[0]


def test_data_file_of_batch_0_is_refused(tmp_path: Path) -> None:
    import numpy as np

    got = _compile_with_data(tmp_path, np.zeros((0, 16), np.float32), [{"name": "b1", "batch": 1, "seq": 1}])
    _one_line_naming_data_file(got, "(0, 16)")


def test_data_file_batch_8_under_a_batch_1_scenario_is_refused(tmp_path: Path) -> None:
    import numpy as np

    got = _compile_with_data(tmp_path, np.ones((8, 16), np.float32), [{"name": "b1", "batch": 1, "seq": 1}])
    _one_line_naming_data_file(got, "(8, 16)", "b1")


def test_data_file_with_nan_or_inf_is_refused(tmp_path: Path) -> None:
    import numpy as np

    a = np.ones((1, 16), np.float32)
    a[0, 3] = np.nan
    a[0, 5] = np.inf
    got = _compile_with_data(tmp_path, a, [{"name": "b1", "batch": 1, "seq": 1}])
    _one_line_naming_data_file(got, "NaN")


def test_data_file_of_the_wrong_dtype_is_refused(tmp_path: Path) -> None:
    import numpy as np

    got = _compile_with_data(tmp_path, np.ones((1, 16), np.float64), [{"name": "b1", "batch": 1, "seq": 1}])
    _one_line_naming_data_file(got, "float64", "float32")


def _validate(tmp_path: Path, data: dict) -> subprocess.CompletedProcess[str]:
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return _run("validate", str(tmp_path / "r.yaml"), cwd=tmp_path)


GPT2 = {"source": "hf_config", "architecture": "gpt2", "task": "causal-lm",
        "config": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64}}


def test_ids_past_a_small_vocabulary_are_refused_at_load(tmp_path: Path) -> None:
    model = {**GPT2, "config": {**GPT2["config"], "vocab_size": 5}}
    ids = {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}
    got = _validate(tmp_path, mlp_recipe(model=model, inputs=[ids], scenarios=[{"name": "s", "batch": 1, "seq": 8}]))
    assert got.returncode == 2, got.stderr
    assert "inputs[0].range" in got.stderr and "vocab_size" in got.stderr and "5" in got.stderr, got.stderr
    # inside the vocabulary: valid
    ok = _validate(tmp_path, mlp_recipe(model=model, inputs=[{**ids, "range": [0, 5]}],
                                        scenarios=[{"name": "s", "batch": 1, "seq": 8}]))
    assert ok.returncode == 0, ok.stderr


def test_a_negative_layer_count_is_refused_at_load(tmp_path: Path) -> None:
    model = {"source": "hf_config", "architecture": "bert", "config": {"num_hidden_layers": -1}}
    ids = {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, 100]}
    got = _validate(tmp_path, mlp_recipe(model=model, inputs=[ids], scenarios=[{"name": "s", "batch": 1, "seq": 8}]))
    assert got.returncode == 2, got.stderr
    assert "model.config.num_hidden_layers" in got.stderr and "-1" in got.stderr, got.stderr
