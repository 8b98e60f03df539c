"""Nothing trusted blindly (issue classes 2, 6, 7): cached stages are checked against the checksums they were
written with, identical stages do not share one folder, a damaged reference is redone; validation runs no user
code and bounds YAML aliases; a factory without a seed gives stage 0 and the export the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import mlp_recipe, write_recipe
from test_recipe import TESTS, run_cli

from optimizer.core.errors import RecipeError
from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import load_recipe


def _run(tmp_path: Path, data: dict | None = None) -> list:
    recipe = load_recipe(write_recipe(tmp_path, data or mlp_recipe()))
    return Pipeline(recipe, tmp_path / "out").execute()


@pytest.mark.slow
def test_an_edited_metrics_file_is_measured_again(tmp_path: Path) -> None:
    _run(tmp_path)
    path = tmp_path / "out" / "02-ort_session" / "metrics.json"
    saved = json.loads(path.read_text())
    saved["metrics"]["scenarios"]["b1"]["latency"]["p50_ms"] = 0.000001  # a number nobody measured
    path.write_text(json.dumps(saved))
    records = _run(tmp_path)
    ort = records[2]
    assert ort.metrics["scenarios"]["b1"]["latency"]["p50_ms"] > 0.000001
    assert "metrics.json" in (ort.cache_note or "") and "measured again" in (ort.cache_note or "")


@pytest.mark.slow
def test_cached_metrics_that_do_not_fit_the_schema_are_measured_again(tmp_path: Path) -> None:
    """A metrics.json with a valid checksum but a layout the typed report cannot read (an older version's, say)
    is measured again, not carried into the report where it would stop the run."""
    from optimizer.engine.stage_cache import metrics_digest

    _run(tmp_path)
    path = tmp_path / "out" / "02-ort_session" / "metrics.json"
    saved = json.loads(path.read_text())
    saved["metrics"]["scenarios"]["b1"]["latency"] = "fast"
    saved["digest"] = metrics_digest(saved["key"], saved)
    path.write_text(json.dumps(saved))
    ort = _run(tmp_path)[2]
    assert isinstance(ort.metrics["scenarios"]["b1"]["latency"], dict)
    assert "does not fit the metrics schema" in (ort.cache_note or "")


@pytest.mark.slow
def test_a_model_file_changed_in_place_at_the_same_size_is_rebuilt(tmp_path: Path) -> None:
    _run(tmp_path)
    model = tmp_path / "out" / "01-export" / "model.onnx"
    data = bytearray(model.read_bytes())
    data[-20] ^= 0xFF  # same size, other bytes
    model.write_bytes(bytes(data))
    records = _run(tmp_path)
    assert records[1].status == "ran" and "rebuilt" in (records[1].cache_note or "")


@pytest.mark.slow
def test_two_identical_stages_keep_their_own_folders(tmp_path: Path) -> None:
    data = mlp_recipe(passes=[
        {"type": "export"},
        {"type": "ort_session", "name": "a", "from": "export"},
        {"type": "ort_session", "name": "b", "from": "export"},
    ])
    for _ in range(2):  # the first run and the cached re-run
        records = _run(tmp_path, data)
        assert [r.status for r in records][2:] in (["ran", "ran"], ["ran", "cached"], ["cached", "cached"])
        for rec in records[2:]:
            assert rec.artifact.path.parent.name == rec.folder and rec.artifact.path.is_file(), rec.name
        assert (tmp_path / "out" / "02-a" / "model.onnx").is_file()
        assert (tmp_path / "out" / "03-b" / "model.onnx").is_file()


@pytest.mark.slow
def test_a_truncated_reference_is_redone(tmp_path: Path) -> None:
    first = _run(tmp_path)
    ref = tmp_path / "out" / "00-source" / "reference.npz"
    ref.write_bytes(ref.read_bytes()[:200])
    records = _run(tmp_path)
    assert [r.status for r in records] == ["cached", "cached", "cached"]
    with np.load(ref) as data:  # written again, whole
        assert len(data.files) > 0
    assert records[2].metrics["accuracy"] == first[2].metrics["accuracy"]


@pytest.mark.slow
def test_unseeded_factory_exports_the_weights_stage_0_ran(tmp_path: Path) -> None:
    data = mlp_recipe(model={"source": "factory", "target": "tiny_models:unseeded_mlp"})
    records = _run(tmp_path, data)
    export = records[1]
    assert export.status == "ran", export.reason
    assert export.metrics["within_budget"] is True
    assert min(a["cosine"] for a in export.metrics["accuracy"].values()) > 0.9999


# ---------------------------------------------------------------- validation runs no user code, bounded YAML
@pytest.mark.slow
def test_validate_does_not_import_the_models_package(tmp_path: Path) -> None:
    pkg = tmp_path / "site" / "sneaky"
    (pkg / "models" / "mini").mkdir(parents=True)
    marker = tmp_path / "imported"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (pkg / "models" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    data = mlp_recipe(model={"source": "hf_folder", "package": "sneaky.models", "path": "mini"})
    recipe = write_recipe(tmp_path, data)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{TESTS}"}
    proc = subprocess.run([sys.executable, "-m", "optimizer", "validate", str(recipe)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists(), "validate ran the package's code"
    missing = write_recipe(tmp_path, mlp_recipe(model={"source": "hf_folder", "package": "sneaky.models",
                                                      "path": "nope"}), "missing.yaml")
    proc = subprocess.run([sys.executable, "-m", "optimizer", "validate", str(missing)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "model.path" in proc.stderr and not marker.exists()


def test_a_yaml_alias_bomb_is_refused_at_load(tmp_path: Path) -> None:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1}, *a{i - 1},"
              f" *a{i - 1}, *a{i - 1}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\nname: bomb\n")  # 10**9 strings once expanded
    with pytest.raises(RecipeError, match="aliases"):
        load_recipe(path)
    proc = run_cli("validate", str(path))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_a_huge_recipe_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "huge.yaml"
    path.write_text("name: huge\ndescription: " + "x" * 3_000_000 + "\n")
    with pytest.raises(RecipeError, match="MB"):
        load_recipe(path)


@pytest.mark.slow
def test_yaml_nested_too_deeply_is_one_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.yaml"
    path.write_text("name: deep\ndescription: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(RecipeError, match="nested too deeply"):
        load_recipe(path)
