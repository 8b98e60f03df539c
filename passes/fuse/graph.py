"""Small helpers over onnx-graphsurgeon graphs, shared by the fusion rules.

onnx-graphsurgeon was chosen over the onnxscript rewriter because the hardest rule here (attention) is a walk
with many optional steps that must say *why* a block did not match; a producer/consumer graph with cleanup
and toposort (what GraphSurgeon gives, and what TensorRT users already know) fits that better than a pattern
DSL whose failures are silent.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from optimizer.core.names import unique_name

MS = "com.microsoft"


def producer(t: gs.Tensor | None, op: str | tuple[str, ...] | None = None) -> gs.Node | None:
    """The node producing t (optionally only if its op is `op`)."""
    if t is None or isinstance(t, gs.Constant) or len(t.inputs) != 1:
        return None
    node = t.inputs[0]
    if op is not None and node.op not in ((op,) if isinstance(op, str) else op):
        return None
    return node


def const(t: gs.Tensor | None) -> np.ndarray | None:
    """The value of a constant tensor (initializer or Constant node output), else None."""
    if t is None:
        return None
    if isinstance(t, gs.Constant):
        return np.asarray(t.values)
    node = producer(t, "Constant")
    if node is not None and "value" in node.attrs and isinstance(node.attrs["value"], gs.Constant):
        return np.asarray(node.attrs["value"].values)
    return None


def scalar(t: gs.Tensor | None) -> float | None:
    v = const(t)
    if v is None or v.size != 1:
        return None
    return float(v.reshape(()))


def close_to(t: gs.Tensor | None, value: float, rtol: float = 1e-3) -> bool:
    v = scalar(t)
    return v is not None and abs(v - value) <= rtol * max(abs(value), 1e-6)


def other_input(node: gs.Node, t: gs.Tensor) -> gs.Tensor | None:
    """For a binary node, the input that is not t."""
    a, b = node.inputs[0], node.inputs[1]
    if a is t:
        return b
    if b is t:
        return a
    return None


def name_of(node: gs.Node) -> str:
    return node.name or f"{node.op}@{id(node):x}"


def name_nodes(graph: gs.Graph) -> None:
    """Give unnamed nodes stable names, so reports and new node names can refer to them."""
    for i, node in enumerate(graph.nodes):
        if not node.name:
            node.name = f"{node.op}_{i}"


def const_tensor(graph: gs.Graph, name: str, value: np.ndarray) -> gs.Constant:
    """A new initializer with a name unique in the graph."""
    return gs.Constant(unique_name(name, set(graph.tensors())), np.ascontiguousarray(value))


def variable(graph: gs.Graph, name: str, dtype: Any = np.float32) -> gs.Variable:
    """A new tensor with a name unique in the graph."""
    return gs.Variable(unique_name(name, set(graph.tensors())), dtype=dtype)


def is_output(graph: gs.Graph, t: gs.Tensor) -> bool:
    return any(o is t for o in graph.outputs)
