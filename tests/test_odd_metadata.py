"""Issue 47, class 8 (part): node metadata is a hint, never a requirement. The dynamo exporter's name_scopes
(a list of module names) is read by onnx_io.node_scopes for the hybrid stages; any other value is ignored."""

from __future__ import annotations

import onnx
import pytest
from onnx import helper

from optimizer.runtime.onnx_io import SCOPE_KEY, node_scopes


def _model(value: str) -> onnx.ModelProto:
    node = helper.make_node("Relu", ["x"], ["y"], name="n")
    node.metadata_props.add(key=SCOPE_KEY, value=value)
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    return helper.make_model(helper.make_graph([node], "g", [x], [y]))


@pytest.mark.parametrize("value", ["5", "'abc'", "[1, 2, 3]", "{'a': 1}", "None", "[[1], [2]]", "[", "1e999",
                                   "'" + "x" * 10000 + "'"])
def test_metadata_that_is_not_a_list_of_names_is_ignored(value: str) -> None:
    assert node_scopes(_model(value)) == {}


def test_the_exporters_own_scopes_are_read() -> None:
    assert node_scopes(_model("['', 'encoder', 'encoder.layer.0', 'relu']")) == {"n": "encoder.layer.0"}
