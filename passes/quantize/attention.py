"""INT8 attention core: com.microsoft Attention written back as standard ops, so that ONNX Runtime's integer kernels
take QK^T and probabilities x V too, not only the QKV projection.

ORT's dynamic quantizer turns a fused Attention into QAttention, whose CPU kernel runs the QKV projection in INT8
and the attention itself (QK^T, softmax, x V) in FP32. That core is O(seq^2): at seq 512 it is about half of an
INT8 MiniLM's time. `unfuse` writes each Attention back as MatMul (projection, keeping the node's name) -> Add ->
per-head Q, K, V -> MatMul (QK^T, scale folded into Q's weights) -> mask -> Softmax -> MatMul (x V), exactly what
the Attention op computes; quantize_dynamic with MatMulConstBOnly off then quantizes the two activation x activation
MatMuls as well (DynamicQuantizeLinear on both sides; ORT fuses each into a DynamicQuantizeMatMul).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optimizer.core.names import unique_name

MS = "com.microsoft"
MASK_FILTER = -10000.0  # the Attention op's mask_filter_value default: (1 - mask) * -10000 added to the scores


@dataclass
class UnfusedAttention:
    """What `unfuse` wrote: per Attention node (name), its projection MatMul (same name) and its two core MatMuls;
    Attention nodes left fused with the reason."""

    core: dict[str, list[str]] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)

    def core_nodes(self) -> list[str]:
        return [n for pair in self.core.values() for n in pair]


def unfuse(model: Any, names: set[str] | None = None) -> UnfusedAttention:
    """Rewrite the (named, or all) com.microsoft Attention nodes of `model` in place; see the module doc."""
    from onnx import helper, numpy_helper, shape_inference

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    ranks = _ranks(shape_inference.infer_shapes(model))
    out = UnfusedAttention()
    nodes: list[Any] = []
    replaced: list[str] = []
    for node in graph.node:
        if node.op_type != "Attention" or node.domain != MS or (names is not None and node.name not in names):
            nodes.append(node)
            continue
        reason = _unsupported(node, inits, ranks)
        if reason:
            out.kept[node.name] = reason
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        w = numpy_helper.to_array(inits[node.input[1]]).copy()
        b = numpy_helper.to_array(inits[node.input[2]]).copy()
        hidden, heads = w.shape[1] // 3, int(attrs["num_heads"])
        scale = float(attrs.get("scale") or 0.0) or 1.0 / float(np.sqrt(hidden // heads))
        w[:, :hidden] *= scale  # the QK^T scale, once on Q's weights rather than on [B, N, S, S] scores
        b[:hidden] *= scale
        nodes.extend(_core(node, w, b, hidden, heads, graph, out))
        replaced += [node.input[1], node.input[2]]
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input}
    dropped = [t for t in graph.initializer if t.name in replaced and t.name not in used]
    for t in dropped:
        graph.initializer.remove(t)
    return out


def _ranks(model: Any) -> dict[str, int]:
    found = {}
    for v in [*model.graph.input, *model.graph.value_info, *model.graph.output]:
        t = v.type.tensor_type
        if t.HasField("shape"):
            found[v.name] = len(t.shape.dim)
    return found


def _unsupported(node: Any, inits: dict[str, Any], ranks: dict[str, int]) -> str | None:
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if attrs.get("unidirectional", 0) or attrs.get("qkv_hidden_sizes") or attrs.get("past_present_share_buffer"):
        return "causal, packed-size or past-state attention"
    extra = [i for i in node.input[4:] if i]
    if extra:
        return "past state or attention bias inputs"
    if len(node.input) < 3 or node.input[1] not in inits or node.input[2] not in inits:
        return "QKV weight or bias is not an initializer"
    if len(inits[node.input[1]].dims) != 2 or inits[node.input[1]].dims[1] % 3:
        return "QKV weight is not [hidden, 3 * hidden]"
    mask = node.input[3] if len(node.input) > 3 else ""
    if mask and ranks.get(mask) != 2:
        return f"mask {mask!r} is not a [batch, seq] 0/1 mask (rank {ranks.get(mask, 'unknown')})"
    return None


def _core(
    node: Any, w: np.ndarray, b: np.ndarray, hidden: int, heads: int, graph: Any, out: UnfusedAttention
) -> list[Any]:
    from onnx import TensorProto, helper, numpy_helper

    n = node.name
    x, y = node.input[0], node.output[0]
    mask = node.input[3] if len(node.input) > 3 else ""

    taken = (
        {m.name for m in graph.node} | {o for m in graph.node for o in m.output} | {i.name for i in graph.initializer}
    )
    made: dict[str, str] = {}

    def t(suffix: str) -> str:
        """A name of this node's rewrite, `<node>_<suffix>` unless the graph already has it."""
        if suffix not in made:
            made[suffix] = unique_name(f"{n}_{suffix}", taken)
        return made[suffix]

    consts = {
        t("qkv_w"): w.astype(np.float32),
        t("qkv_b"): b.astype(np.float32),
        t("heads_shape"): np.array([0, 0, 3, heads, hidden // heads], np.int64),
        t("out_shape"): np.array([0, 0, hidden], np.int64),
        t("i0"): np.array(0, np.int64),
        t("i1"): np.array(1, np.int64),
        t("i2"): np.array(2, np.int64),
    }
    written = [
        helper.make_node("MatMul", [x, t("qkv_w")], [t("qkv")], name=n),
        helper.make_node("Add", [t("qkv"), t("qkv_b")], [t("qkv_biased")], name=t("bias")),
        helper.make_node("Reshape", [t("qkv_biased"), t("heads_shape")], [t("split_heads")], name=t("reshape")),
        # [B, S, 3, N, D] -> [3, B, N, S, D]
        helper.make_node("Transpose", [t("split_heads")], [t("qkv_bnsd")], perm=[2, 0, 3, 1, 4], name=t("perm")),
        helper.make_node("Gather", [t("qkv_bnsd"), t("i0")], [t("q")], axis=0, name=t("q")),
        helper.make_node("Gather", [t("qkv_bnsd"), t("i1")], [t("k")], axis=0, name=t("k")),
        helper.make_node("Gather", [t("qkv_bnsd"), t("i2")], [t("v")], axis=0, name=t("v")),
        helper.make_node("Transpose", [t("k")], [t("k_t")], perm=[0, 1, 3, 2], name=t("k_t")),
        helper.make_node("MatMul", [t("q"), t("k_t")], [t("scores")], name=t("qk")),
    ]
    scores = t("scores")
    if mask:
        consts[t("one")] = np.array(1.0, np.float32)
        consts[t("filter")] = np.array(MASK_FILTER, np.float32)
        consts[t("mask_axes")] = np.array([1, 2], np.int64)
        written += [
            helper.make_node("Cast", [mask], [t("mask_f")], to=TensorProto.FLOAT, name=t("mask_cast")),
            helper.make_node("Sub", [t("one"), t("mask_f")], [t("mask_off")], name=t("mask_off")),
            helper.make_node("Mul", [t("mask_off"), t("filter")], [t("mask_bias")], name=t("mask_bias")),
            helper.make_node("Unsqueeze", [t("mask_bias"), t("mask_axes")], [t("mask_b11s")], name=t("mask_b11s")),
            helper.make_node("Add", [scores, t("mask_b11s")], [t("masked")], name=t("masked")),
        ]
        scores = t("masked")
    written += [
        helper.make_node("Softmax", [scores], [t("probs")], axis=-1, name=t("softmax")),
        helper.make_node("MatMul", [t("probs"), t("v")], [t("context")], name=t("pv")),
        helper.make_node("Transpose", [t("context")], [t("context_bsnd")], perm=[0, 2, 1, 3], name=t("merge")),
        helper.make_node("Reshape", [t("context_bsnd"), t("out_shape")], [y], name=t("out")),
    ]
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in consts.items())
    for new in written:
        new.metadata_props.extend(node.metadata_props)  # the module each node came from stays known
    out.core[n] = [t("qk"), t("pv")]
    return written
