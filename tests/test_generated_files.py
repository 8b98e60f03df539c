"""Issue 47, class 1: files we generate from a model never take dictation. A graph input name or a file name is a
value: in recipe.yaml it is written by the YAML emitter (header comments included, through optimizer.core.markup),
in report.md it stays inside its line and cell. A name holding a newline adds no key, an ESC gives no ReaderError,
and the checksum line keeps telling generated from edited.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import compile_mlp

from optimizer.cli.auto_compile import edited, prepare_model_recipe
from optimizer.recipe.loading import load_recipe

INJECT = "x\nseed: 7\nbatch_sweep: {batches: [1, 2], latency_budget_ms: 5}\n#"


def one_matmul(path: Path, name: str) -> Path:
    import onnx
    from onnx import TensorProto, helper

    w = helper.make_tensor("w", TensorProto.FLOAT, [16, 4], np.random.default_rng(0).random(64).tolist())
    graph = helper.make_graph(
        [helper.make_node("MatMul", [name, "w"], [f"y{name}"])], "g",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info(f"y{name}", TensorProto.FLOAT, ["batch", 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def _generated(model: Path, out: Path) -> tuple[dict, str]:
    path = prepare_model_recipe(str(model), "cpu", out)
    text = path.read_text()
    data = yaml.safe_load(text)
    load_recipe(path)  # the recipe it wrote validates
    return data, text


@pytest.mark.parametrize("name", [INJECT, "x\x1b[2J\x1b[32mok", "x\u2028seed: 3", "x\r\nseed: 3", "x\x85seed: 3"])
def test_input_name_adds_no_key_to_the_generated_recipe(tmp_path: Path, name: str) -> None:
    data, text = _generated(one_matmul(tmp_path / "m.onnx", name), tmp_path / "run")
    assert "seed" not in data and "batch_sweep" not in data, text
    assert [i["name"] for i in data["inputs"]] == [name]  # the name itself kept, byte for byte
    assert not edited(text)  # still ours: the checksum covers what was written


@pytest.mark.parametrize("stem", ["m\nseed: 9\nx", "m\x1b[2Jx", "m\u2029seed: 9\nx"])
def test_file_name_adds_no_key_to_the_generated_recipe(tmp_path: Path, stem: str) -> None:
    model = one_matmul(tmp_path / f"{stem}.onnx", "x")
    data, text = _generated(model, tmp_path / "run")
    assert "seed" not in data, text
    assert data["model"]["path"] == str(model.resolve())
    assert not edited(text)


def test_every_header_line_is_a_comment(tmp_path: Path) -> None:
    _, text = _generated(one_matmul(tmp_path / f"a{INJECT}.onnx", INJECT), tmp_path / "run")
    body = text.partition("# sha256 of the YAML below: ")[0]
    assert all(line.startswith("# ") for line in body.splitlines()), body


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_mlp(tmp_path_factory.mktemp("md") / "run")


def test_report_markdown_keeps_model_text_inside_its_line_and_cell(compiled: Path, tmp_path: Path) -> None:
    from optimizer.report.markdown import to_markdown
    from optimizer.report.schema import parse_report

    data = json.loads((compiled / "report.json").read_text())
    data["findings"] = ["slow\n\n## Injected heading\n<script>alert(1)</script>"]
    data["stages"][2]["status"] = "skipped"
    data["stages"][2]["reason"] = "why | extra cell\n| fake | row |"
    text = to_markdown(parse_report(data, "report.json"))
    assert "\n## Injected" not in text and "<script>" not in text
    assert "\n| fake" not in text
    rows = [line for line in text.splitlines() if line.startswith("| 02 ort_session | export |")]
    header = next(line for line in text.splitlines() if line.startswith("| stage"))
    assert rows and all(line.count(" | ") == header.count(" | ") for line in rows), rows


def test_compare_yaml_is_emitted(tmp_path: Path) -> None:
    """compare.yaml was already yaml.safe_dump: the same writer for the generated recipe keeps it so."""
    shutil.rmtree(tmp_path, ignore_errors=True)
    from optimizer.core.markup import yaml_document

    text = yaml_document({"name": INJECT}, header=[f"from {INJECT}"])
    assert yaml.safe_load(text) == {"name": INJECT}
