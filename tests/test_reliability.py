"""Bad models, bad inputs, concurrent runs and external data: clear failures, nothing lost."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import mlp_recipe, write_recipe
from onnx import TensorProto, helper
from test_recipe import run_cli

from optimizer.core.errors import OptimizerError
from optimizer.engine.pipeline import Pipeline
from optimizer.engine.rundir import RunDir
from optimizer.recipe.loading import load_recipe
from optimizer.runtime import onnx_io


def onnx_recipe(tmp_path: Path, model_file: str) -> Path:
    data = mlp_recipe(
        model={"source": "onnx", "path": model_file},
        inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
        passes=[{"type": "ort_session"}],
    )
    return write_recipe(tmp_path, data)


def good_model() -> onnx.ModelProto:
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3], np.arange(12, dtype=np.float32).tolist())
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def compile_cli(recipe: Path, out: Path) -> tuple[int, str, dict]:
    proc = run_cli("compile", str(recipe), "--out", str(out))
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else {}
    return proc.returncode, proc.stderr, report


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["truncated", "not_onnx", "unknown_op", "fails_checker"])
def test_bad_onnx_models_fail_stage_0_with_the_reason(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "model.onnx"
    model = good_model()
    if kind == "truncated":
        path.write_bytes(model.SerializeToString()[:40])
    elif kind == "not_onnx":
        path.write_text("this is a text file, not a model\n")
    elif kind == "unknown_op":
        model.graph.node[0].op_type = "NoSuchOp"
        model.graph.node[0].domain = "com.example"
        model.opset_import.append(helper.make_opsetid("com.example", 1))
        onnx.save(model, str(path))
    else:
        model.graph.node[0].input[1] = "missing_tensor"  # uses a tensor nothing produces
        onnx.save(model, str(path))
    rc, stderr, report = compile_cli(onnx_recipe(tmp_path, "model.onnx"), tmp_path / "out")
    assert rc == 1, stderr
    assert report["stages"][0]["status"] == "failed"
    reason = report["stages"][0]["reason"]
    expected = {
        "truncated": "not a readable ONNX model",
        "not_onnx": "not a readable ONNX model",
        "unknown_op": "onnxruntime cannot load it",
        "fails_checker": "fails onnx.checker",
    }[kind]
    assert expected in reason and str(path) in reason
    assert report["stages"][1]["status"] == "not run"
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_input_name_mismatch_is_a_usage_error(tmp_path: Path) -> None:
    data = mlp_recipe(inputs=[{"name": "pixels", "dtype": "float32", "shape": ["batch", 16]}])
    recipe = write_recipe(tmp_path, data)
    rc, stderr, _ = compile_cli(recipe, tmp_path / "out")
    assert rc == 2
    assert stderr.strip() == (f"error: {recipe}: inputs[0].name: 'pixels' is not an input of MLP.forward (it takes: x)")


@pytest.mark.slow
def test_scenario_longer_than_the_model_takes(tmp_path: Path) -> None:
    data = mlp_recipe(
        model={
            "source": "hf_config",
            "architecture": "bert",
            "config": {
                "num_hidden_layers": 1,
                "hidden_size": 32,
                "num_attention_heads": 2,
                "intermediate_size": 64,
                "vocab_size": 100,
                "max_position_embeddings": 64,
            },
        },
        inputs=[{"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"], "range": [0, 100]}],
        scenarios=[{"name": "ok", "batch": 1, "seq": 32}, {"name": "long", "batch": 1, "seq": 128}],
        outputs=["last_hidden_state"],
    )
    rc, stderr, _ = compile_cli(write_recipe(tmp_path, data), tmp_path / "out")
    assert rc == 2
    assert "scenarios[1].seq: 128 is longer than the model takes (its positions stop at 64); use seq <= 64" in stderr


@pytest.mark.slow
def test_on_failure_continue_runs_later_stages_from_the_last_good_artifact(tmp_path: Path) -> None:
    data = mlp_recipe(
        on_failure="continue", passes=[{"type": "export", "config": {"min_cosine": 1.5}}, {"type": "ort_session"}]
    )
    recipe = load_recipe(write_recipe(tmp_path, data))
    records = Pipeline(recipe, tmp_path / "out", measure=False).execute()
    assert [r.status for r in records] == ["ran", "failed", "skipped"]
    assert "disagrees with PyTorch" in records[1].reason
    # The failed export passes stage 0's artifact on; ort_session declines it with its reason.
    assert records[2].reason == "takes onnx artifacts, got torch"


def test_a_second_writer_to_the_same_run_folder_is_refused(tmp_path: Path) -> None:
    first = RunDir(tmp_path / "out")
    first.prepare()
    try:
        with pytest.raises(OptimizerError, match="another optimizer run .* is writing to this run folder"):
            RunDir(tmp_path / "out").prepare()
    finally:
        first.release()
    RunDir(tmp_path / "out").prepare()  # free again once the first writer is done


def test_unwritable_run_folder_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OptimizerError, match="cannot write the run folder"):
        RunDir(blocker / "out").prepare()


@pytest.mark.slow
def test_external_data_through_every_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Models past 2 GB keep their weights in a side file; the threshold is lowered to exercise that path."""
    monkeypatch.setattr(onnx_io, "EXTERNAL_DATA_THRESHOLD", 1024)
    data = mlp_recipe(
        passes=[
            {"type": "export"},
            {"type": "ort_session"},
            {"type": "fuse"},
            {"type": "quantize", "config": {"mode": "int8_dynamic"}},
        ]
    )
    data["model"]["kwargs"] = {"hidden": 256}
    data["inputs"] = [{"name": "x", "dtype": "float32", "shape": ["batch", 4, 16]}]
    records = Pipeline(load_recipe(write_recipe(tmp_path, data)), tmp_path / "out").execute()
    assert all(r.ok for r in records), [(r.name, r.reason) for r in records]
    for rec in records[1:]:
        folder = rec.artifact.path.parent
        assert list(folder.glob("*.data")), f"{rec.name}: no external data file in {folder}"
        assert rec.metrics["accuracy"]["logits"]["cosine"] > 0.99
        onnx_io.check(rec.artifact.path)


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (lambda d: d.update(passes=[{"type": "fuze"}]), "passes[0].type", "unknown pass 'fuze'"),
        (
            lambda d: d.update(passes=[{"type": "fuse", "config": {"rulez": []}}]),
            "passes[0].config.rulez",
            "Extra inputs are not permitted",
        ),
        (lambda d: d.update(scenarios=[{"name": "b1", "batch": "one"}]), "scenarios[0].batch", "valid integer"),
        (lambda d: d.update(model={"source": "onnx", "path": "missing.onnx"}), "model.path", "no such file"),
        (
            lambda d: d["passes"].append({"type": "quantize", "config": {"mode": "int4"}}),
            "passes[2].config.mode",
            "Input should be",
        ),
    ],
    ids=["unknown-pass", "misspelled-field", "wrong-type", "missing-model", "bad-enum"],
)
def test_bad_recipe_classes_exit_2_with_one_line(tmp_path: Path, change, field: str, words: str) -> None:  # type: ignore[no-untyped-def]
    data = mlp_recipe()
    change(data)
    recipe = write_recipe(tmp_path, data)
    proc = run_cli("compile", str(recipe))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith(f"error: {recipe}: {field}: ") and words in lines[0]


@pytest.mark.slow
def test_disk_full_during_a_pass_keeps_earlier_stages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    real_save = onnx_io.save
    calls = {"n": 0}

    def failing_save(model, path):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if "fuse" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_save(model, path)

    monkeypatch.setattr(onnx_io, "save", failing_save)
    data = mlp_recipe(passes=[{"type": "export"}, {"type": "fuse"}])
    out = tmp_path / "out"
    records = Pipeline(load_recipe(write_recipe(tmp_path, data)), out).execute()
    assert [r.status for r in records] == ["ran", "ran", "failed"]
    assert "No space left on device" in records[2].reason
    assert (out / "01-export" / "model.onnx").is_file() and (out / "01-export" / "metrics.json").is_file()
    assert not list(out.glob(".building-*"))  # the half-built stage was removed, not left to be trusted
