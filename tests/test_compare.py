"""`optimizer compare A B`: two ONNX files under one harness, interleaved, explained by op type; the slowdown recipe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import FAST_BENCH, TESTS
from onnx import TensorProto, helper, numpy_helper

from optimizer.cli.app import main
from optimizer.core.errors import OptimizerError
from optimizer.engine.compare import compare_recipe, file_side, parse_scenario

BENCH = ",".join(f"{k}={v}" for k, v in FAST_BENCH.items())
WIDTH = 128


def tiny(path: Path, pairs: int = 0, input_name: str = "x", dtype: int = TensorProto.FLOAT) -> Path:
    """x [batch, 128, 128] -> MatMul -> Relu -> MatMul. With `pairs`, that many Transpose -> Cast to FP16 -> Cast
    back -> Transpose chains before the first MatMul: the same result to FP16 rounding, and slower on purpose."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / 8, "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((WIDTH, WIDTH)).astype(np.float32) / 8, "w2")
    nodes, cur = [], input_name
    if dtype != TensorProto.FLOAT:
        nodes.append(helper.make_node("Cast", [cur], ["xf"], to=TensorProto.FLOAT))
        cur = "xf"
    for i in range(pairs):
        nodes += [
            helper.make_node("Transpose", [cur], [f"t{i}"], perm=[0, 2, 1]),
            helper.make_node("Cast", [f"t{i}"], [f"h{i}"], to=TensorProto.FLOAT16),
            helper.make_node("Cast", [f"h{i}"], [f"f{i}"], to=TensorProto.FLOAT),
            helper.make_node("Transpose", [f"f{i}"], [f"u{i}"], perm=[0, 2, 1]),
        ]
        cur = f"u{i}"
    nodes += [helper.make_node("MatMul", [cur, "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
              helper.make_node("MatMul", ["r", "w2"], ["y"])]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info(input_name, dtype, ["batch", WIDTH, WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH, WIDTH])], [w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def run_compare(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(["compare", *args])
    out = capsys.readouterr()
    return int(exited.value.code or 0), out.out, out.err


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("pair")
    return tiny(folder / "a.onnx"), tiny(folder / "b.onnx", pairs=8)


def test_b_slower_on_purpose_is_called_slower_and_explained(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = pair
    out = tmp_path / "cmp"
    code, stdout, err = run_compare(capsys, str(a), str(b), "--out", str(out), "--ort-level", "disable_all",
                                    "--bench", BENCH, "--threads", "1", "--format", "json")
    assert code == 0, err
    s: dict[str, Any] = json.loads(stdout)
    assert s["graph_optimization_level"] == "disable_all" and s["a"]["stage"] == "source" and s["b"]["stage"] == "b"
    (row,) = s["scenarios"]
    assert row["scenario"] == "b1" and row["ratio"] > 1.5 and row["low"] > 1.0, row  # B/A latency, beyond noise
    assert row["verdict"] == "B slower" and row["launches"] == "n/a on cpu"
    assert s["accuracy"]["y"]["cosine"] > 0.9999 and 0 < s["accuracy"]["y"]["max_abs"] < 0.01
    assert s["kernels_run"] == {"a": 3, "b": 35}  # ORT ran every node: 3 in A, 3 + 8 x 4 in B
    why = s["explanation"]
    new = {r["op"] for r in why["rows"] if r["change"] == "new"}
    assert new == {"Transpose", "Cast"}, why["rows"]
    assert "Transpose" in why["summary"] and "Cast" in why["summary"] and "(new)" in why["summary"]
    # The run folder is a normal report, plus the comparison and the recipe that reproduces it.
    for name in ("report.json", "report.md", "report.html", "compare.json", "compare.md", "compare.yaml"):
        assert (out / name).is_file(), name
    assert "B slower" in (out / "compare.md").read_text()
    # RUN:stage names the same files from that run: A its stage 0, B its substituted stage.
    from optimizer.report.compare import resolve_side

    side_a, side_b = resolve_side("A", f"{out}:source"), resolve_side("B", f"{out}:b")
    assert side_a.path == a.resolve() and side_b.path.name == "model.onnx"
    assert side_b.runtime["graph_optimization_level"] == "disable_all"
    r, notes = compare_recipe(side_a, side_b)  # the run's scenarios and benchmark come along
    assert [sc.name for sc in r.scenarios] == ["b1"] and r.benchmark.rounds == FAST_BENCH["rounds"]
    assert any("B ran with graph_optimization_level disable_all" in n for n in notes)


def test_both_run_with_the_same_ort_level(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stage 0 of an ONNX source runs with ORT's optimizations off: by default A gets an ort_session stage first,
    so A and B both run with level all (and the output says so)."""
    a, b = pair
    out = tmp_path / "cmp"
    code, stdout, err = run_compare(capsys, str(a), str(b), "--out", str(out), "--bench", BENCH, "--threads", "1",
                                    "--scenario", "batch=2")
    assert code == 0, err
    assert "graph_optimization_level=all" in stdout and "b2" in stdout
    report = json.loads((out / "report.json").read_text())
    stages = {st["name"]: st for st in report["stages"]}
    assert [st["name"] for st in report["stages"]] == ["source", "a", "b"] and stages["b"]["parent"] == "a"
    for name in ("a", "b"):
        assert stages[name]["metrics"]["runtime"]["graph_optimization_level"] == "all", name
    assert stages["source"]["metrics"]["runtime"]["graph_optimization_level"] == "disable_all"


def test_bad_input_is_one_line(pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, _ = pair
    renamed = tiny(tmp_path / "renamed.onnx", input_name="pixels")
    half = tiny(tmp_path / "half.onnx", dtype=TensorProto.FLOAT16)
    cases = [
        ([str(tmp_path / "missing.onnx"), str(a)], "A: no such file"),
        ([str(a), str(renamed)], "input names of A"),
        ([str(a), str(half)], "input dtypes of A"),
        ([str(a), str(a), "--scenario", "batch=x"], "is not a whole number"),
        ([str(a), str(a), "--bench", "rounds=1"], "--bench: rounds"),
        ([str(a), f"{tmp_path}:fuse"], "no report.json"),
    ]
    for args, expected in cases:
        code, _, err = run_compare(capsys, *args, "--out", str(tmp_path / "never"))
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, (args, err)
    assert "takes ['pixels']" in run_compare(capsys, str(a), str(renamed))[2]
    assert "x: float32 vs float16" in run_compare(capsys, str(a), str(half))[2]
    assert not (tmp_path / "never").exists()


def test_scenarios_bind_the_graphs_dims(tmp_path: Path) -> None:
    assert parse_scenario("batch=2,seq=64") == {"dims": {}, "batch": 2, "seq": 64, "name": "b2-s64"}
    assert parse_scenario("batch=4", with_seq=False)["name"] == "b4"
    a = tiny(tmp_path / "a.onnx")
    model = onnx.load(str(a))
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "width"  # a dim no default binds
    onnx.save(model, str(tmp_path / "w.onnx"))
    side = file_side("A", str(tmp_path / "w.onnx"))
    with pytest.raises(OptimizerError, match="symbolic dim 'width' of input 'x' has no size"):
        compare_recipe(side, side)
    r, _ = compare_recipe(side, side, scenarios=["batch=1,width=128"], level="disable_all")
    assert r.inputs[0].shape == ["batch", "width", WIDTH] and r.scenarios[0].dims == {"width": 128}
    assert [p.type for p in r.passes] == ["substitute"]


@pytest.mark.slow
def test_slowdown_recipe_names_the_responsible_op_type(tmp_path: Path) -> None:
    """recipes/slowdown-cpu.yaml: unfused INT8 (QDQ) without ORT's optimizations, slower than its FP32 input
    beyond noise; the inversion finding names DequantizeLinear, new in that stage."""
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import load_recipe
    from optimizer.report.build import build_report

    recipe = load_recipe(TESTS.parent / "recipes" / "slowdown-cpu.yaml")
    records = Pipeline(recipe, tmp_path / "run").execute()
    assert all(r.ok for r in records), [(r.name, r.reason) for r in records]
    report = build_report(recipe, records, tmp_path / "run", 1.0)
    vs = report.stages[-1].metrics.scenarios["b1-s16"].vs_parent  # type: ignore[union-attr]
    assert vs is not None and vs.verdict == "slower" and vs.high < 0.7, vs
    finding = next(f for f in report.findings if f.startswith("int8_qdq (quantize) on b1-s16:"))
    assert "slower than its input (export)" in finding and "DequantizeLinear +" in finding, finding
    assert "(new)" in finding.split("DequantizeLinear", 1)[1][:20], finding
