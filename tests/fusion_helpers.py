"""Build a tiny ONNX graph, run fusion rules on it, and compare outputs before and after with ORT."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from passes.fuse import RULES_BY_NAME, apply_rules
from passes.fuse.context import RuleContext
from passes.fuse.graph import name_nodes
from passes.fuse.probe import add_contrib_opset, probe_values
from passes.fuse.rule import RuleReport


def model(
    nodes: list[Any], inputs: list[Any], outputs: list[str], inits: dict[str, np.ndarray], opset: int = 17
) -> Any:
    graph = helper.make_graph(
        nodes,
        "test",
        inputs,
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return onnx.shape_inference.infer_shapes(m)


def float_input(name: str, shape: list[Any]) -> Any:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def run(m: Any, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, feed)


def fuse(
    m: Any, feed: dict[str, np.ndarray], rules: list[str], target: str = "cpu"
) -> tuple[Any, dict[str, RuleReport]]:
    graph = gs.import_onnx(m)
    name_nodes(graph)
    ctx = RuleContext(target, int(graph.opset), feed, probe_values(graph, feed))  # type: ignore[arg-type]
    reports = {}
    for name in rules:  # one at a time, to hold each rule to the op types it declares
        before = Counter(n.op for n in graph.nodes)
        reports.update(apply_rules(graph, [name], ctx))
        added = {op for op, n in Counter(n.op for n in graph.nodes).items() if n > before[op]}
        assert added <= set(RULES_BY_NAME[name].emits), f"{name} wrote {added}, declares {RULES_BY_NAME[name].emits}"
    out = gs.export_onnx(graph)
    add_contrib_opset(out)
    return out, reports


def ops(m: Any) -> Counter[str]:
    return Counter(n.op_type for n in m.graph.node)


def assert_same(before: Any, after: Any, feed: dict[str, np.ndarray], atol: float = 1e-5) -> None:
    for a, b in zip(run(before, feed), run(after, feed), strict=True):
        np.testing.assert_allclose(a, b, atol=atol, rtol=1e-4)
