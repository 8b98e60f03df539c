"""Recipe validation: every error names the file and the field, before anything runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import TESTS, mlp_recipe, write_recipe

from optimizer.core.errors import RecipeError
from optimizer.recipe.loading import load_recipe


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    return subprocess.run(
        [sys.executable, "-m", "optimizer", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


def expect_error(tmp_path: Path, data: Any, field: str, words: str) -> None:
    path = write_recipe(tmp_path, data)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert info.value.field == field, str(info.value)
    assert words in str(info.value)
    assert str(path) in str(info.value)


def test_valid_recipe_loads(tiny_recipe: Path) -> None:
    recipe = load_recipe(tiny_recipe)
    assert [p.stage_name for p in recipe.passes] == ["export", "ort_session"]
    assert recipe.scenarios[1].bindings() == {"batch": 8, "seq": 1}


def test_shipped_recipes_validate() -> None:
    for path in sorted((TESTS.parent / "recipes").glob("*.yaml")):
        load_recipe(path)


def test_unknown_pass(tmp_path: Path) -> None:
    expect_error(tmp_path, mlp_recipe(passes=[{"type": "exprot"}]), "passes[0].type", "unknown pass 'exprot'")


def test_misspelled_pass_config_field(tmp_path: Path) -> None:
    data = mlp_recipe(passes=[{"type": "export", "config": {"opsett": 17}}])
    expect_error(tmp_path, data, "passes[0].config.opsett", "Extra inputs are not permitted")


def test_wrong_type(tmp_path: Path) -> None:
    data = mlp_recipe(benchmark={"rounds": "many"})
    expect_error(tmp_path, data, "benchmark.rounds", "valid integer")


def test_misspelled_top_level_field(tmp_path: Path) -> None:
    data = mlp_recipe()
    data["scenarioz"] = data.pop("scenarios")
    path = write_recipe(tmp_path, data)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert info.value.field in ("scenarios", "scenarioz")


def test_missing_model_path(tmp_path: Path) -> None:
    data = mlp_recipe(model={"source": "onnx", "path": "nowhere/model.onnx"})
    expect_error(tmp_path, data, "model.path", "no such file")


def test_unknown_model_source_names_the_choices(tmp_path: Path) -> None:
    data = mlp_recipe(model={"source": "tensorflow", "path": "x"})
    path = write_recipe(tmp_path, data)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert "hf_folder" in str(info.value) and info.value.field == "model"


def test_from_must_name_an_earlier_stage(tmp_path: Path) -> None:
    data = mlp_recipe(passes=[{"type": "export"}, {"type": "ort_session", "from": "fuse"}])
    expect_error(tmp_path, data, "passes[1].from", "no earlier stage named 'fuse'")


def test_duplicate_stage_names(tmp_path: Path) -> None:
    data = mlp_recipe(passes=[{"type": "export"}, {"type": "ort_session"}, {"type": "ort_session"}])
    expect_error(tmp_path, data, "passes[2].name", "used twice")


def test_unbound_dim(tmp_path: Path) -> None:
    data = mlp_recipe(inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", "features"]}])
    expect_error(tmp_path, data, "inputs[0].shape", "dim 'features' is not bound by scenario 'b1'")


def test_bad_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nmodel: [unclosed\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert "not valid YAML" in str(info.value) and "line" in str(info.value)


def test_cli_validate_bad_recipe_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, mlp_recipe(passes=[{"type": "export", "config": {"exporter": "onnx2"}}]))
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"{path}: passes[0].config.exporter" in lines[0]
    assert "Traceback" not in proc.stderr


def test_cli_missing_recipe_file(tmp_path: Path) -> None:
    proc = run_cli("compile", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2
    assert "nope.yaml: no such recipe file" in proc.stderr


def test_cli_passes_lists_every_pass() -> None:
    proc = run_cli("passes")
    assert proc.returncode == 0
    for name in ("export", "ort_session"):
        assert name in proc.stdout


@pytest.mark.parametrize("bad", ["../outside", "/tmp/abs", "a/b", "x\x00y", "a|b", "n" * 300, ".hidden", ""])
def test_names_that_would_become_paths_are_refused(tmp_path: Path, bad: str) -> None:
    """Stage, scenario and recipe names become folder names: one safe rule, checked when the recipe loads."""
    expect_error(tmp_path, mlp_recipe(name=bad), "name", "not a safe name")
    scenarios = [{"name": bad, "batch": 1}]
    expect_error(tmp_path, mlp_recipe(scenarios=scenarios), "scenarios[0].name", "not a safe name")
    passes = [{"type": "export", "name": bad}]
    expect_error(tmp_path, mlp_recipe(passes=passes), "passes[0].name", "not a safe name")
    assert not any(p.name.startswith(("outside", "abs")) for p in tmp_path.parent.iterdir())


def test_run_folder_refuses_a_stage_folder_outside_it(tmp_path: Path) -> None:
    from optimizer.core.errors import OptimizerError
    from optimizer.engine.rundir import RunDir

    run = RunDir(tmp_path / "run")
    assert run.stage_dir(3, "fuse") == tmp_path / "run" / "03-fuse"
    with pytest.raises(OptimizerError, match="outside the run folder"):
        run.stage_dir(3, "x/../../elsewhere")


@pytest.mark.parametrize(
    ("patch", "field", "words"),
    [
        ({"accuracy": {"metric": "cosine", "min": float("nan")}}, "accuracy.min", "finite"),
        ({"accuracy": {"metric": "max_abs", "max": float("inf")}}, "accuracy.max", "finite"),
        ({"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", -16]}]}, "inputs[0].shape[1]", "greater"),
        ({"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 16], "range": [1, 0]}]}, "inputs[0].range",
         "low < high"),
        ({"batch_sweep": {"batches": [4, 0], "latency_budget_ms": 10}}, "batch_sweep.batches[1]", "greater"),
    ],
)
def test_numbers_that_cannot_be_numbers_are_refused(tmp_path: Path, patch: dict, field: str, words: str) -> None:
    expect_error(tmp_path, mlp_recipe(**patch), field, words)
