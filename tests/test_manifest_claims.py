"""Issue 47, class 3: what a manifest says is true of the model it ships. verify checks each claim it can against
the model itself (inputs and outputs: names, dtypes, shapes; the precision), a reference.npz holding a pickled
object is one problem line (and is never unpickled), and an export of a stage outside the accuracy budget says so
in its output and its manifest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import compile_mlp

from optimizer.cli.app import main
from optimizer.core.artifact import file_sha256
from optimizer.deploy.export import export_bundle
from optimizer.deploy.verify import verify_bundle
from optimizer.report.history import load_report


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_mlp(tmp_path_factory.mktemp("claims") / "run")


@pytest.fixture(scope="module")
def bundle(compiled: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_bundle(load_report(str(compiled)), "ort_session", "onnx", tmp_path_factory.mktemp("b") / "b")


def _claims(bundle: Path, tmp_path: Path, change: Any) -> list[str]:
    root = tmp_path / "b"
    shutil.copytree(bundle, root)
    manifest = json.loads((root / "manifest.json").read_text())
    change(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest))
    return verify_bundle(root)


def test_the_bundle_as_exported_verifies(bundle: Path) -> None:
    assert verify_bundle(bundle) == []


@pytest.mark.parametrize("label, change, words", [
    ("input dtype", lambda m: m["inputs"][0].update(dtype="float16", onnx_type="FLOAT16"), "inputs.x: dtype"),
    ("input shape", lambda m: m["inputs"][0].update(shape=["batch", 32]), "inputs.x: shape"),
    ("output dtype", lambda m: m["outputs"][0].update(dtype="int64"), "dtype"),
    ("output shape", lambda m: m["outputs"][0].update(shape=[1, 2, 3]), "shape"),
    ("an input the model lacks", lambda m: m["inputs"].append({**m["inputs"][0], "name": "extra"}), "extra"),
    ("precision int8 on an FP32 model", lambda m: m["precision"].update(mode="int8"), "precision"),
    ("precision fp16 on an FP32 model", lambda m: m["precision"].update(mode="fp16"), "precision"),
])
def test_a_claim_the_model_contradicts_is_a_problem(bundle: Path, tmp_path: Path, label: str, change: Any,
                                                    words: str) -> None:
    problems = _claims(bundle, tmp_path, change)
    assert any(words in p and "manifest.json" in p for p in problems), problems


def test_pickled_reference_is_one_problem_line_and_never_loaded(bundle: Path, tmp_path: Path) -> None:
    root = tmp_path / "b"
    shutil.copytree(bundle, root)
    with np.load(root / "reference.npz") as ref:
        arrays = {k: ref[k] for k in ref.files}
    key = next(iter(arrays))
    arrays[key] = np.array([{"a": 1}, None], dtype=object)
    np.savez(root / "reference.npz", **arrays)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["files"]["reference.npz"] = file_sha256(root / "reference.npz")
    (root / "manifest.json").write_text(json.dumps(manifest))
    problems = verify_bundle(root)
    assert len(problems) == 1 and "reference.npz" in problems[0] and "pickle" in problems[0], problems


def test_export_of_a_rejected_stage_says_so(compiled: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(compiled, run)
    data = json.loads((run / "report.json").read_text())
    stage = next(s for s in data["stages"] if s["name"] == "ort_session")
    stage["metrics"]["within_budget"] = False  # as a stage outside the accuracy budget is recorded
    (run / "report.json").write_text(json.dumps(data))
    with pytest.raises(SystemExit) as e:
        main(["export", str(run), "--stage", "ort_session", "--out", str(tmp_path / "b")])
    assert e.value.code in (0, None)
    got = capsys.readouterr()
    assert "REJECTED" in got.out + got.err
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["accuracy_budget"]["within"] is False
    assert "REJECTED" in manifest["accuracy_budget"]["verdict"]
