"""Hybrid INT8 / FP16 / FP32 for cuda and tensorrt targets, searched on the CPU by simulation (issue 16).

A 5-MatMul graph with two nodes made sensitive on purpose: `outlier_in` reads a tensor with one channel 10^4
times the others (a per-tensor INT8 scale wipes the rest out; its weights ignore that channel), and
`outlier_overflow` reads the same kind of tensor and has weights beyond float16's range (FP16 overflows)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import FAST_BENCH, write_recipe
from onnx import TensorProto, helper, numpy_helper

from optimizer.core.artifact import Artifact
from optimizer.core.pass_base import PassContext
from optimizer.engine.pipeline import Pipeline
from optimizer.measure.services import MeasureServices
from optimizer.recipe.loading import load_recipe
from optimizer.runtime.inputs import build_feeds
from passes.quantize import precision_graph as pg
from passes.quantize.config import QuantizeConfig
from passes.quantize.hybrid_gpu import choose
from passes.quantize.quantize_pass import QuantizePass

D = 32
NORMAL = ["normal_1", "normal_2", "normal_3"]


def sensitive_graph(path: Path) -> None:
    rng = np.random.default_rng(0)
    inits: list[Any] = []
    nodes: list[Any] = []

    def w(name: str, arr: Any) -> str:
        inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), name))
        return name

    def node(op: str, name: str, inputs: list[str], out: str) -> None:
        nodes.append(helper.make_node(op, inputs, [out], name=name))

    spike = np.ones(D)
    spike[0] = 1e4
    w_in = rng.normal(0, D**-0.5, (D, D))
    w_in[0] = 0
    w_over = rng.normal(0, D**-0.5, (D, D)) * 1e5  # beyond float16's 65504
    w_over[0] = 0
    node("MatMul", "normal_1", ["x", w("W1", rng.normal(0, D**-0.5, (D, D)))], "h1")
    node("Mul", "spike_1", ["h1", w("spike", spike)], "h1s")
    node("MatMul", "outlier_in", ["h1s", w("W_in", w_in)], "hb")
    node("Mul", "spike_2", ["hb", "spike"], "hbs")
    node("MatMul", "outlier_overflow", ["hbs", w("W_over", w_over)], "ha")
    node("Mul", "down", ["ha", w("small", np.float32(1e-5))], "had")
    node("MatMul", "normal_2", ["had", w("W2", rng.normal(0, D**-0.5, (D, D)))], "h2")
    node("Relu", "relu", ["h2"], "h2r")
    node("MatMul", "normal_3", ["h2r", w("W3", rng.normal(0, D**-0.5, (D, D)))], "y")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, D])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, D])
    model = helper.make_model(
        helper.make_graph(nodes, "sensitive", [x], [y], inits), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    onnx.save(model, str(path))


def recipe_data(device: str = "cuda") -> dict[str, Any]:
    return {
        "name": "hybrid-gpu",
        "model": {"source": "onnx", "path": "sensitive.onnx"},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4, D]}],
        "outputs": ["y"],
        "scenarios": [{"name": "b2", "batch": 2, "seq": 1}],
        "target": {"device": device},
        "benchmark": FAST_BENCH,
        "accuracy": {"metric": "cosine", "min": 0.99, "samples": 2},
        "passes": [{"type": "quantize", "config": {"mode": "hybrid", "calibration": {"samples": 4}}}],
    }


def run_pass(folder: Path, services: Any = None) -> tuple[dict[str, Any], dict[str, Any], Path]:
    """The quantize pass in hybrid mode for a cuda target, run directly: (notes, hybrid_search.json, model)."""
    sensitive_graph(folder / "sensitive.onnx")
    recipe = load_recipe(write_recipe(folder, recipe_data()))
    stage = folder / "stage"
    stage.mkdir()
    ctx = PassContext(recipe, "hybrid", stage, build_feeds(recipe, 2), services or MeasureServices())
    config = QuantizeConfig.model_validate({"mode": "hybrid", "calibration": {"samples": 4}})
    quantize = QuantizePass(config)
    src = Artifact("onnx", folder / "sensitive.onnx", {})
    assert quantize.skip_reason(src, ctx) is None  # it declined cuda targets before
    result = quantize.run(src, ctx)
    assert result.artifact.path is not None
    return result.notes_json(), json.loads((stage / "hybrid_search.json").read_text()), result.artifact.path


@pytest.fixture(scope="module")
def searched(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any], Path]:
    return run_pass(tmp_path_factory.mktemp("hybrid_gpu"))


def test_each_node_gets_the_precision_its_sensitivity_allows(searched: Any) -> None:
    notes, record, _ = searched
    precision = {n["node"]: n["precision"] for n in record["nodes"]}
    assert precision == {
        "normal_1": "int8",
        "outlier_in": "fp16",
        "outlier_overflow": "fp32",
        "normal_2": "int8",
        "normal_3": "int8",
    }
    sens = {n["node"]: n for n in record["nodes"]}
    for name in NORMAL:  # harmless in either precision
        assert sens[name]["sensitivity_int8"] < 1e-3 and sens[name]["sensitivity_fp16"] < 1e-5
    assert sens["outlier_in"]["sensitivity_int8"] > 0.5 and sens["outlier_in"]["sensitivity_fp16"] < 1e-5
    assert sens["outlier_overflow"]["sensitivity_int8"] > 0.5 and sens["outlier_overflow"]["sensitivity_fp16"] > 0.5
    assert record["counts"] == {"int8": 3, "fp16": 1, "fp32": 1} == notes["counts"]
    assert notes["int8_nodes"] == NORMAL and notes["fp32_nodes"] == ["outlier_overflow"]
    assert record["flops_share"] == {"int8": 0.6, "fp16": 0.2, "fp32": 0.2}  # five MatMuls of equal size


def test_simulated_accuracy_is_within_budget_and_recorded(searched: Any) -> None:
    _, record, _ = searched
    assert record["simulated_on"] == "cpu" and record["budget"] == 0.99
    assert 0.99 <= record["simulated"]["cosine"] < 1.0
    assert "needs the GPU" in record["speed"]
    # the deployable graph (real FP16 kernels on ORT's CPU provider) agrees with its simulation
    assert abs(record["deployable"]["cpu"]["cosine"] - record["simulated"]["cosine"]) < 1e-3
    assert "not run" in record["deployable"]["gpu"] or "real" in record


def _types(model: Any) -> dict[str, int]:
    graph = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
    return types | {t.name: t.data_type for t in graph.initializer}


def test_deployable_graph_types(searched: Any) -> None:
    _, _, path = searched
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path))
    types = _types(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    by_name = {n.name: n for n in model.graph.node}
    fp16 = by_name["outlier_in"]
    assert [types[t] for t in fp16.input] == [TensorProto.FLOAT16] * 2 and fp16.input[1] in inits
    assert types[fp16.output[0]] == TensorProto.FLOAT16
    assert [types[t] for t in by_name["outlier_overflow"].input] == [TensorProto.FLOAT] * 2
    for name in NORMAL:
        node = by_name[name]
        dqs = [producer[t] for t in node.input]
        assert [d.op_type for d in dqs] == ["DequantizeLinear"] * 2
        act, weight = dqs
        assert inits[act.input[2]].dtype == np.int8 and not inits[act.input[2]].any()  # symmetric: zero point 0
        assert producer[act.input[0]].op_type == "QuantizeLinear"
        assert inits[weight.input[0]].dtype == np.int8 and inits[weight.input[1]].shape == (D,)  # per channel
        assert not inits[weight.input[2]].any()
    assert pg.mixed_float_inputs(model) == []
    assert [types[i.name] for i in [*model.graph.input, *model.graph.output]] == [TensorProto.FLOAT] * 2
    assert sum(n.op_type == "Cast" for n in model.graph.node) == 2  # into and out of the one FP16 node


def chain(n: int) -> Any:
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.normal(size=(8, 8)).astype(np.float32), f"W{i}") for i in range(n)]
    names = ["x", *(f"h{i}" for i in range(n - 1)), "y"]
    nodes = [helper.make_node("MatMul", [names[i], f"W{i}"], [names[i + 1]], name=f"m{i}") for i in range(n)]
    nodes.append(helper.make_node("Relu", ["h0"], ["side"], name="side"))  # an FP32 reader of an FP16 output
    io = [helper.make_tensor_value_info(t, TensorProto.FLOAT, [2, 8]) for t in ("x", "y", "side")]
    return helper.make_model(
        helper.make_graph(nodes, "chain", io[:1], io[1:], inits), opset_imports=[helper.make_opsetid("", 17)]
    )


def test_adjacent_fp16_nodes_share_their_casts() -> None:
    model = pg.write(chain(3), {"m0": "fp16", "m1": "fp16", "m2": "fp16"}, {}, simulate=False)
    casts = [(n.input[0], n.output[0]) for n in model.graph.node if n.op_type == "Cast"]
    # one into FP16 at the start, one back for the graph output, one back for the FP32 Relu; none in between
    assert sorted(casts) == [("h0__fp16", "h0"), ("x", "x__to16"), ("y__fp16", "y")]
    assert pg.mixed_float_inputs(model) == []
    onnx.checker.check_model(model, full_check=True)
    feed = {"x": np.random.default_rng(2).normal(size=(2, 8)).astype(np.float32)}
    import onnxruntime as ort

    ref = ort.InferenceSession(chain(3).SerializeToString()).run(None, feed)
    for graph in (model, pg.write(chain(3), dict.fromkeys(["m0", "m1", "m2"], "fp16"), {}, simulate=True)):
        got = ort.InferenceSession(graph.SerializeToString()).run(None, feed)
        assert all(np.allclose(g, r, rtol=1e-2, atol=1e-2) for g, r in zip(got, ref, strict=True))


def test_mixed_float_inputs_are_found() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2])
    half = numpy_helper.from_array(np.ones(2, np.float16), "half")
    model = helper.make_model(
        helper.make_graph([helper.make_node("Add", ["x", "half"], ["y"], name="bad")], "g", [x], [y], [half]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    assert pg.mixed_float_inputs(model) == ["bad (Add): inputs of types [1, 10]"]


def test_choice_fp16_floor_then_most_int8_within_budget() -> None:
    """Cosine drops add up (a model of the search): FP16 where it keeps the budget, INT8 on top up to it."""
    s8 = {"a": 0.001, "b": 0.002, "c": 0.004, "d": 0.5, "e": 0.5}
    s16 = {"a": 1e-5, "b": 1e-5, "c": 1e-5, "d": 1e-5, "e": 0.5}
    share = dict.fromkeys(s8, 0.2)

    def evaluate(plan: dict[str, str]) -> dict[str, float]:
        drop = sum({"int8": s8, "fp16": s16}.get(p, {}).get(n, 0.0) for n, p in plan.items())
        return {"cosine": 1 - drop}

    plan, points, final = choose(list(s8), s8, s16, share, evaluate, target=0.995)
    assert plan == {"a": "int8", "b": "int8", "c": "fp16", "d": "fp16", "e": "fp32"}  # c's INT8 would reach 0.993
    assert final["cosine"] == pytest.approx(1 - 0.003 - 2e-5)
    assert all(p["cosine"] >= 0.995 for p in points if (p["int8"], p["fp16"]) in ((0, 4), (2, 2)))


@pytest.mark.slow
def test_cuda_recipe_builds_without_a_gpu(tmp_path: Path) -> None:
    """--no-bench: stage 0 of a cuda recipe on a CPU machine is built, not measured, and the hybrid runs."""
    from optimizer.runtime.gpu import ort_cuda_reason

    if ort_cuda_reason() is None:
        pytest.skip("this machine can run the cuda target: stage 0 is measured")
    sensitive_graph(tmp_path / "sensitive.onnx")
    recipe = load_recipe(write_recipe(tmp_path, recipe_data()))
    records = Pipeline(recipe, tmp_path / "out", measure=False).execute()
    assert [r.status for r in records] == ["ran", "ran"], [(r.name, r.reason) for r in records]
    assert all(r.reason.startswith("not measured: ") for r in records)
    assert records[1].notes["counts"] == {"int8": 3, "fp16": 1, "fp32": 1}
    measured = Pipeline(recipe, tmp_path / "measured").execute()  # a measuring run still stops at stage 0
    assert measured[0].status == "failed" and measured[1].status == "not run"


class CudaOnCpu(MeasureServices):
    """Sessions asked for on "cuda" open on the CPU and are counted: the GPU comparison's code path, injected."""

    def __init__(self) -> None:
        super().__init__()
        self.cuda_sessions: list[str] = []

    def session(self, artifact: Artifact, ctx: PassContext, device: str = "cpu") -> Any:
        if device == "cuda":
            assert artifact.path is not None
            self.cuda_sessions.append(artifact.path.name)
        return super().session(artifact, ctx, "cpu")


def test_real_cosine_recorded_beside_the_simulated_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import optimizer.runtime.gpu

    monkeypatch.setattr(optimizer.runtime.gpu, "ort_cuda_reason", lambda: None)
    services = CudaOnCpu()
    notes, record, _ = run_pass(tmp_path, services)
    assert services.cuda_sessions == ["model.onnx"]  # the deployable graph, once
    assert record["deployable"]["gpu"]["on"] == "onnxruntime CUDAExecutionProvider"
    assert record["real"] == record["deployable"]["gpu"]["cosine"] == notes["real"]
    assert record["simulated_minus_real"] == pytest.approx(record["simulated"]["cosine"] - record["real"])
    assert abs(record["simulated_minus_real"]) < 1e-3


@pytest.mark.gpu
def test_simulation_matches_the_gpu(tmp_path: Path) -> None:
    """On a real GPU: the deployable graph on ORT's CUDA provider within 0.002 of the CPU simulation's cosine."""
    from optimizer.runtime.gpu import ort_cuda_reason

    if ort_cuda_reason() is not None:
        pytest.skip(ort_cuda_reason() or "")
    _, record, _ = run_pass(tmp_path)
    assert record["real"] >= 0.98 and abs(record["simulated_minus_real"]) < 2e-3, record["deployable"]
