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
    # 24 chains: B about 3x A. With 8 (1.7x) a busy moment once put the interval's low end at 0.96.
    return tiny(folder / "a.onnx"), tiny(folder / "b.onnx", pairs=24)


@pytest.mark.slow
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
    assert s["kernels_run"] == {"a": 3, "b": 99}  # ORT ran every node: 3 in A, 3 + 24 x 4 in B
    why = s["explanation"]
    new = {r["op"] for r in why["rows"] if r["change"] == "new"}
    assert new == {"Transpose", "Cast"}, why["rows"]
    assert "Transpose" in why["summary"] and "Cast" in why["summary"] and "(new)" in why["summary"]
    assert f"B/A {row['ratio']:.2f}x: B slower" in why["coverage"] and "did not move" not in why["coverage"], why
    digits = 4 if row["p50_b_ms"] < 0.1 else 3
    assert f"{row['p50_a_ms']:.{digits}f} -> {row['p50_b_ms']:.{digits}f} ms" in why["coverage"], why
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


@pytest.mark.slow
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
    from optimizer.recipe.loading import parse_recipe

    assert parse_scenario("batch=2,seq=64") == {"dims": {}, "batch": 2, "seq": 64, "name": "b2-s64"}
    assert parse_scenario("batch=4", with_seq=False)["name"] == "b4"
    a = tiny(tmp_path / "a.onnx")
    model = onnx.load(str(a))
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "width"  # compile --model calls it seq
    onnx.save(model, str(tmp_path / "w.onnx"))
    side = file_side("A", str(tmp_path / "w.onnx"))
    r, _ = compare_recipe(side, side, scenarios=["batch=1,width=64"], level="disable_all")
    assert r.inputs[0].shape == ["batch", "seq", WIDTH] and (r.scenarios[0].seq, r.scenarios[0].name) == (64, "b1-s64")
    assert [p.type for p in r.passes] == ["substitute"]
    # A recipe's own dim that a --scenario does not size: one line naming it.
    base = parse_recipe({"name": "w", "model": {"source": "onnx", "path": str(a)},
                         "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", "width", WIDTH]}],
                         "scenarios": [{"name": "b1", "batch": 1, "dims": {"width": 8}}], "passes": []},
                        "<test>", tmp_path)
    with pytest.raises(OptimizerError, match="symbolic dim 'width' of input 'x' has no size"):
        compare_recipe(side, side, base=base, scenarios=["batch=2"])
    r, _ = compare_recipe(side, side, base=base, scenarios=["batch=1,width=128"], level="disable_all")
    assert r.inputs[0].shape == ["batch", "width", WIDTH] and r.scenarios[0].dims == {"width": 128}


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
    # the inversion's finding (a busy machine may add an unstable-timing one for the same stage first)
    finding = next(f for f in report.findings
                   if f.startswith("int8_qdq (quantize) on b1-s16:") and "slower than its input (export)" in f)
    assert "DequantizeLinear +" in finding, finding
    assert "(new)" in finding.split("DequantizeLinear", 1)[1][:20], finding


def odd(path: Path, rows: int = 100, constant_table: bool = False) -> Path:
    """Like an old exporter's graph: dims named 'batch size', 'sequence-length' and 'N', token ids gathering from a
    `rows`-row embedding table (an initializer, or a Constant node's output, which no inference can see)."""
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.standard_normal((rows, 16)).astype(np.float32), "E")
    w = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "W")
    nodes = [helper.make_node("Gather", ["E", "token ids"], ["emb"]),
             helper.make_node("MatMul", ["feat", "W"], ["proj"])]
    inits = [table, w]
    if constant_table:
        nodes.insert(0, helper.make_node("Constant", [], ["E"], value=table))
        inits = [w]
    graph = helper.make_graph(
        nodes, "odd",
        [helper.make_tensor_value_info("token ids", TensorProto.INT64, ["batch size", "sequence-length"]),
         helper.make_tensor_value_info("feat", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["batch size", "sequence-length", 16]),
         helper.make_tensor_value_info("proj", TensorProto.FLOAT, ["N", 16])], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_graph_inputs_are_inferred_as_compile_model_does(tmp_path: Path) -> None:
    """Integer inputs take the range of the embedding table they index (as `compile --model` infers them), not
    [0, 1000); the graph's odd dim names are renamed the same way, and --scenario takes either name."""
    from optimizer.recipe.auto import recipe_for_model

    side = file_side("A", str(odd(tmp_path / "odd.onnx")))
    r, notes = compare_recipe(side, side, scenarios=["batch size=1,sequence-length=8"], level="disable_all")
    ids, feat = r.inputs
    assert tuple(ids.range or ()) == (0, 100) and ids.shape == ["batch", "seq"] and feat.shape == ["batch", 16]
    assert (r.scenarios[0].batch, r.scenarios[0].seq, r.scenarios[0].name) == (1, 8, "b1-s8")
    assert any("'batch size' -> batch" in n and "'sequence-length' -> seq" in n for n in notes), notes
    compiled, _ = recipe_for_model(str(tmp_path / "odd.onnx"), "cpu")
    assert [(s.name, s.shape, s.range, s.fill) for s in compiled.inputs] == [
        (s.name, s.shape, s.range, s.fill) for s in r.inputs
    ]
    r2, _ = compare_recipe(side, side, scenarios=["batch=2,seq=4"], level="disable_all")  # the new names work too
    assert (r2.scenarios[0].batch, r2.scenarios[0].seq) == (2, 4)
    with pytest.raises(OptimizerError, match="'batch size' and 'N' are both `batch`"):
        compare_recipe(side, side, scenarios=["batch size=1,N=2"])
    with pytest.raises(OptimizerError, match="'width' is not a dim of the inputs"):
        compare_recipe(side, side, scenarios=["batch=1,width=3"])


@pytest.mark.slow
def test_odd_graph_runs_and_inputs_that_do_not_fit_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = odd(tmp_path / "odd.onnx")
    code, stdout, err = run_compare(capsys, str(model), str(model), "--out", str(tmp_path / "ok"), "--scenario",
                                    "batch size=1,sequence-length=8", "--ort-level", "disable_all", "--bench", BENCH,
                                    "--format", "json")
    assert code == 0, err
    assert json.loads(stdout)["scenarios"][0]["scenario"] == "b1-s8"
    # A table no inference can see (a Constant's output, 1 row): the generated ids in [0, 2) overflow it in ORT.
    hidden = odd(tmp_path / "hidden.onnx", rows=1, constant_table=True)
    code, _, err = run_compare(capsys, str(hidden), str(hidden), "--out", str(tmp_path / "bad"), "--ort-level",
                               "disable_all", "--bench", BENCH)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "do not fit A" in err and "--recipe" in err and "Gather" in err, err


def _patched_run(out: Path, stage: str, **fields: Any) -> None:
    path = out / "report.json"
    report = json.loads(path.read_text())
    for st in report["stages"]:
        if st["name"] == stage:
            st.update(fields)
    path.write_text(json.dumps(report))


@pytest.mark.slow
def test_run_stage_that_was_skipped_or_failed_is_refused(pair: tuple[Path, Path], tmp_path: Path) -> None:
    from optimizer.report.compare import resolve_side

    a, b = pair
    out = tmp_path / "cmp"
    with pytest.raises(SystemExit):
        main(["compare", str(a), str(b), "--out", str(out), "--ort-level", "disable_all", "--bench", BENCH])
    assert resolve_side("B", f"{out}:b").path.name == "model.onnx"
    _patched_run(out, "b", status="skipped", reason="b: nothing to quantize: no MatMul")
    with pytest.raises(OptimizerError) as skipped:
        resolve_side("B", f"{out}:b")
    assert str(skipped.value) == (
        f"B: stage 'b' of {out} was skipped (nothing to quantize: no MatMul); its model is its parent 'source''s"
    )
    _patched_run(out, "b", status="failed", reason="b: Fail: cannot fuse")
    with pytest.raises(OptimizerError, match=r"B: stage 'b' of .* failed \(Fail: cannot fuse\)"):
        resolve_side("B", f"{out}:b")


def test_why_line_agrees_with_the_verdict() -> None:
    """A slowdown beyond noise that is tiny in ms (0.010 -> 0.013 ms, 1.31x) must not read 'did not move'."""
    from optimizer.report.compare import ScenarioRow, coverage_line
    from optimizer.report.explain import Explanation, OpDelta

    e = Explanation("B", "A", "b1", "call", [OpDelta("Transpose", 0.0, 0.025)], 0.003)
    row = ScenarioRow(scenario="b1", p50_a_ms=0.010, p50_b_ms=0.013, ratio=1.31, low=1.2, high=1.4,
                      verdict="B slower", rounds=None, launches_a=None, launches_b=None, launches="n/a on cpu")
    line = coverage_line(e, row)
    assert "did not move" not in line and "0.0100 -> 0.0130 ms" in line and "+0.0030 ms" in line, line
    assert "1.31x" in line and "B slower" in line, line
