"""Passes compose: `fuse` then `quantize` (int8_static) on ResNet-style CNNs quantizes the convolutions, from
PyTorch and from an opset-9 ONNX file built the way old model zoos wrote them (IR version 3, every initializer
also listed as a graph input); and a quantization with nothing to quantize says so instead of "running"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from conftest import FAST_BENCH, mlp_recipe, write_recipe
from onnx import TensorProto, helper, numpy_helper

from optimizer.engine.pipeline import Pipeline
from optimizer.recipe.loading import load_recipe
from optimizer.runtime.sessions import ort_session

BUDGET = 0.99  # the recipes' cosine budget
INT8_STATIC = {"type": "quantize", "config": {"mode": "int8_static", "calibration": {"samples": 4}}}


def old_zoo_resnet(path: Path, c: int = 8, seed: int = 0) -> int:
    """A ResNet stem and one basic block at opset 9, IR version 3, each initializer also a graph input (what
    exporters of 2018 wrote, and what the ONNX model zoo's ResNets still are). Returns its number of Convs."""
    rng = np.random.default_rng(seed)

    def he(cout: int, cin: int, k: int) -> np.ndarray:
        return rng.normal(0, np.sqrt(2 / (cin * k * k)), (cout, cin, k, k))

    inits: dict[str, np.ndarray] = {"w0": he(c, 3, 3), "b0": rng.normal(0, 0.1, c)}
    for i in (0, 1, 2):
        inits |= {
            f"g{i}": rng.uniform(0.5, 1.5, c),
            f"be{i}": rng.normal(0, 0.1, c),
            f"mu{i}": rng.normal(0, 0.1, c),
            f"var{i}": rng.uniform(0.5, 2, c),
        }
    inits |= {"w1": he(c, c, 3), "w2": he(c, c, 3), "fc": rng.normal(0, 0.3, (10, c)), "fcb": rng.normal(0, 0.1, 10)}
    inits = {k: np.asarray(v, np.float32) for k, v in inits.items()}

    def bn(i: int, x: str, y: str) -> Any:
        return helper.make_node("BatchNormalization", [x, f"g{i}", f"be{i}", f"mu{i}", f"var{i}"], [y])

    pads = {"pads": [1, 1, 1, 1]}
    nodes = [
        helper.make_node("Conv", ["data", "w0", "b0"], ["c0"], **pads),
        bn(0, "c0", "n0"),
        helper.make_node("Relu", ["n0"], ["r0"]),
        helper.make_node("MaxPool", ["r0"], ["p0"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p0", "w1"], ["c1"], **pads),
        bn(1, "c1", "n1"),
        helper.make_node("Relu", ["n1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], **pads),
        bn(2, "c2", "n2"),
        helper.make_node("Add", ["n2", "p0"], ["s"]),
        helper.make_node("Relu", ["s"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["gap"]),
        helper.make_node("Flatten", ["gap"], ["flat"]),
        helper.make_node("Gemm", ["flat", "fc", "fcb"], ["prob"], transB=1),
    ]
    inputs = [helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, 3, 32, 32])]
    inputs += [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in inits.items()]
    graph = helper.make_graph(
        nodes,
        "resnet_v1_style",
        inputs,
        [helper.make_tensor_value_info("prob", TensorProto.FLOAT, [1, 10])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=3)
    onnx.checker.check_model(model)  # valid as it is: at IR 3 initializers must be graph inputs
    onnx.save(model, str(path))
    return sum(n.op_type == "Conv" for n in nodes)


def compile_stages(tmp_path: Path, data: dict[str, Any], run: str = "out") -> dict[str, Any]:
    records = Pipeline(load_recipe(write_recipe(tmp_path, data, f"{run}.yaml")), tmp_path / run).execute()
    return {r.name: r for r in records}


def cnn_recipe(model: dict[str, Any], input_name: str, shape: list[Any], passes: list[Any]) -> dict[str, Any]:
    return mlp_recipe(
        name="cnn",
        model=model,
        inputs=[{"name": input_name, "dtype": "float32", "shape": shape, "range": [-1, 1]}],
        scenarios=[{"name": "b1", "batch": 1, "seq": 1}],
        benchmark=FAST_BENCH,
        accuracy={"metric": "cosine", "min": BUDGET, "samples": 2},
        passes=passes,
    )


def quantized_convs(model: Any) -> int:
    """Convs whose data and weight both come out of a DequantizeLinear (the QDQ form of an INT8 Conv)."""
    dq_outputs = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return sum(n.op_type == "Conv" and n.input[0] in dq_outputs and n.input[1] in dq_outputs for n in model.graph.node)


def cpu_kernels(path: Path, tmp_path: Path) -> dict[str, int]:
    """Op types of the graph ONNX Runtime's CPU provider runs after its own optimizations (QDQ -> QLinear*)."""
    optimized = tmp_path / "ort_optimized.onnx"
    ort_session(path, {"graph_optimization_level": "extended"}, 1, optimized_path=str(optimized))
    counts: dict[str, int] = {}
    for node in onnx.load(str(optimized)).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def assert_convs_quantized(stages: dict[str, Any], convs: int, tmp_path: Path) -> None:
    fuse, quant = stages["fuse"], stages["quantize"]
    assert fuse.status == "ran" and fuse.notes["fused_ops"].get("FusedConv", 0) >= 2, fuse.notes["fused_ops"]
    assert quant.status == "ran", quant.reason
    model = onnx.load(str(quant.artifact.path))
    assert quantized_convs(model) == convs  # every convolution, the ones fusion had turned into FusedConv too
    assert not any(n.op_type == "FusedConv" for n in model.graph.node)
    assert quant.notes["unfused_convs"] == fuse.notes["fused_ops"]["FusedConv"]
    kernels = cpu_kernels(quant.artifact.path, tmp_path)
    assert kernels.get("QLinearConv", 0) == convs and "Conv" not in kernels, kernels
    # The activations folded into the INT8 convolutions' output ranges: no Relu is left to run in FP32.
    assert "Relu" not in kernels, kernels
    cosine = quant.metrics["accuracy"][next(iter(quant.metrics["accuracy"]))]["cosine"]
    assert BUDGET <= cosine < 1.0 and quant.metrics["within_budget"] is True


@pytest.mark.slow
def test_old_zoo_model_fuse_then_int8_static(tmp_path: Path) -> None:
    convs = old_zoo_resnet(tmp_path / "resnet_v1.onnx")
    data = cnn_recipe(
        {"source": "onnx", "path": "resnet_v1.onnx"}, "data", [1, 3, 32, 32], [{"type": "fuse"}, INT8_STATIC]
    )
    stages = compile_stages(tmp_path, data)
    fused = onnx.load(str(stages["fuse"].artifact.path))
    onnx.checker.check_model(fused)  # its initializers are no longer inputs: valid only at IR version >= 4
    assert fused.ir_version >= 4 and [i.name for i in fused.graph.input] == ["data"]
    assert stages["fuse"].notes["ir_version"] == {"input": 3, "output": fused.ir_version}
    assert_convs_quantized(stages, convs, tmp_path)


@pytest.mark.slow
def test_pytorch_resnet_export_fuse_then_int8_static(tmp_path: Path) -> None:
    model = {
        "source": "factory",
        "target": "optimizer.runtime.zoo:resnet",
        "kwargs": {"layers": [1, 1], "width": 8, "classes": 10},
    }
    passes = [{"type": "export"}, {"type": "ort_session"}, {"type": "fuse"}, INT8_STATIC]
    stages = compile_stages(tmp_path, cnn_recipe(model, "pixel_values", ["batch", 3, 32, 32], passes))
    # stem, two per basic block, and the second block's 1x1 downsample
    assert_convs_quantized(stages, 6, tmp_path)


def constant_node_mlp(path: Path) -> None:
    """Two MatMuls whose weights are Constant nodes' outputs, not initializers."""
    rng = np.random.default_rng(0)

    def weight(name: str, shape: tuple[int, int]) -> Any:
        value = numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32))
        return helper.make_node("Constant", [], [name], value=value)

    nodes = [
        weight("w1", (16, 32)),
        weight("w2", (32, 4)),
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="act"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.mark.slow
def test_int8_dynamic_with_weights_from_nodes_says_nothing_to_quantize(tmp_path: Path) -> None:
    constant_node_mlp(tmp_path / "m.onnx")
    data = mlp_recipe(
        model={"source": "onnx", "path": "m.onnx"},
        passes=[{"type": "quantize", "config": {"mode": "int8_dynamic"}}],
    )
    quant = compile_stages(tmp_path, data, "alone")["quantize"]
    assert quant.status == "skipped"
    assert "nothing to quantize" in quant.reason and "fc1, fc2" in quant.reason and "initializer" in quant.reason
    # What the reason advises works: `fuse` folds the Constant nodes into initializers, then both MatMuls are INT8.
    data["passes"].insert(0, {"type": "fuse"})
    quant = compile_stages(tmp_path, data, "fused")["quantize"]
    assert quant.status == "ran" and quant.metrics["graph"]["op_types"]["MatMulInteger"] == 2


def test_a_quantization_that_wrote_nothing_quantized_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the check before the run (here switched off), the pass counts what it really quantized."""
    from passes.quantize import modes

    monkeypatch.setattr(modes, "nothing_to_quantize", lambda *args: None)
    constant_node_mlp(tmp_path / "m.onnx")
    data = mlp_recipe(
        model={"source": "onnx", "path": "m.onnx"},
        passes=[{"type": "quantize", "config": {"mode": "int8_dynamic"}}],
    )
    quant = compile_stages(tmp_path, data, "alone")["quantize"]
    assert quant.status == "failed" and "int8_dynamic quantized nothing" in quant.reason


@pytest.mark.slow
def test_int8_static_without_a_node_of_its_op_types_says_nothing_to_quantize(tmp_path: Path) -> None:
    only_conv = {"type": "quantize", "config": {"mode": "int8_static", "op_types": ["Conv"]}}
    data = mlp_recipe(passes=[{"type": "export"}, only_conv])
    quant = compile_stages(tmp_path, data)["quantize"]
    assert quant.status == "skipped"
    assert "nothing to quantize" in quant.reason and "no Conv node" in quant.reason
