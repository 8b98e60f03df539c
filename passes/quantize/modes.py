"""The plain quantization modes, each a thin layer over onnxruntime.quantization / ORT's float16 converter.

int8_dynamic: weights INT8 ahead of time (per channel optionally), activations quantized at run time per
  tensor; ORT fuses the result into DynamicQuantizeMatMul / QAttention kernels (VNNI on x86).
int8_static:  QDQ format (QuantizeLinear/DequantizeLinear around each quantized op) with activation ranges
  from calibration (MinMax, Entropy or Percentile): the explicit-quantization form TensorRT 10/11 take.
fp16:         every float tensor and op in FP16 except the op types / nodes on the block lists; with
  keep_io_types the model's inputs and outputs stay FP32.

Composing with `fuse`: the CPU fusion writes Conv + activation (+ residual Add) as com.microsoft.FusedConv, which
ORT's quantizer does not know. The INT8 modes first write each FusedConv back as Conv [+ Add] [+ activation]
(`unfuse_convs`, exact), so the convolutions are quantized; see `unfuse_convs` for why this beats the other ways.
int8_static with per-channel weights lifts a graph below opset 13 to 13 first (`quantizer_input`). A graph with
no node the mode can quantize is declined before it runs (`nothing_to_quantize`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optimizer.core.names import unique_name
from optimizer.core.quiet import quiet

# A tensor ONNX shape inference cannot type (a MatMul fed by a contrib op of `fuse`, e.g. BiasGelu) is FP32 in
# every graph we quantize; without this, ORT's quantizer stops with "Unable to find data type for weight_name".
UNTYPED_IS_FLOAT = {"DefaultTensorType": 1}  # onnx.TensorProto.FLOAT, spelled as the int so onnx loads lazily
DEFAULT_OPS = ["MatMul", "Attention", "Gemm", "Conv"]
# What onnxruntime's dynamic quantizer rewrites (it leaves Gemm alone: that is for the static modes).
DYNAMIC_OPS = {"MatMul", "Attention", "Conv", "Gather", "LSTM", "EmbedLayerNormalization"}


def int8_dynamic(
    src: Path,
    dst: Path,
    per_channel: bool,
    ops: list[str],
    nodes: list[str] | None,
    exclude: list[str],
    const_b_only: bool = True,
    reduce_range: bool | None = None,
) -> None:
    """const_b_only=False also quantizes MatMuls whose both inputs are activations (the attention core once
    attention.unfuse wrote it as MatMuls); pass `nodes` to say which. reduce_range None: as the CPU needs
    (runtime.cpu_features.int8_reduce_range: 7-bit weights on x86 without VNNI)."""
    from optimizer.runtime.cpu_features import int8_reduce_range

    if reduce_range is None:
        reduce_range = int8_reduce_range()[0]
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with quiet():
        quantize_dynamic(
            str(src),
            str(dst),
            per_channel=per_channel,
            reduce_range=reduce_range,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=ops,
            nodes_to_quantize=nodes or [],
            nodes_to_exclude=exclude,
            extra_options={**UNTYPED_IS_FLOAT, **({} if const_b_only else {"MatMulConstBOnly": False})},
        )


def int8_static(
    src: Path,
    dst: Path,
    reader: Any,
    method: str,
    per_channel: bool,
    symmetric_activations: bool,
    ops: list[str],
    exclude: list[str],
    percentile: float,
    quantize_bias: bool = True,
) -> None:
    """quantize_bias False (config.quantize_bias: cuda targets) keeps biases in float: TensorRT takes no int32 Q/DQ."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    calibrate = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[method]
    extra = {"ActivationSymmetric": symmetric_activations, "WeightSymmetric": True, "CalibPercentile": percentile,
             "QuantizeBias": quantize_bias, **UNTYPED_IS_FLOAT}
    with quiet():
        quantize_static(
            str(src),
            str(dst),
            reader,
            quant_format=QuantFormat.QDQ,
            per_channel=per_channel,
            activation_type=QuantType.QInt8 if symmetric_activations else QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=[o for o in ops if o != "Attention"],
            nodes_to_exclude=exclude,
            calibrate_method=calibrate,
            extra_options=extra,
        )


def fp16(model: Any, keep_io_types: bool, op_block_list: list[str], node_block_list: list[str]) -> Any:
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    with quiet():
        return convert_float_to_float16(
            model,
            keep_io_types=keep_io_types,
            op_block_list=list(DEFAULT_OP_BLOCK_LIST) + op_block_list,
            node_block_list=node_block_list,
        )


def quantizable_nodes(model: Any, ops: list[str]) -> list[str]:
    """Names of the nodes a dynamic quantization would touch: op type listed, with a constant weight input."""
    inits = {t.name for t in model.graph.initializer}
    out = []
    for node in model.graph.node:
        if node.op_type in ops and node.op_type in DYNAMIC_OPS and len(node.input) > 1 and node.input[1] in inits:
            out.append(node.name)
    return out


# ------------------------------------------------------------------ composing with `fuse`
MS = "com.microsoft"
# Standard ops whose QDQ form ORT's CPU provider runs in INT8 or folds away: a Relu or Clip after a quantized Conv
# becomes that Conv's output range (with uint8 activations the quantizer drops it: the zero point clamps), Add
# becomes QLinearAdd, LeakyRelu and Sigmoid QLinearLeakyRelu / QLinearSigmoid. Tanh and HardSigmoid have no INT8
# kernel: they stay FP32.
INT8_FOLLOWERS = frozenset({"Add", "Relu", "Clip", "LeakyRelu", "Sigmoid"})
# FusedConv's activations and how many activation_params each takes (ORT's contrib op definition).
FUSED_ACTIVATIONS = {"Relu": 0, "Sigmoid": 0, "Tanh": 0, "LeakyRelu": 1, "HardSigmoid": 2, "Clip": 2}


@dataclass
class UnfusedConvs:
    """What `unfuse_convs` wrote back: the Convs (each keeps its FusedConv's name, so exclude_nodes still
    names it), the Add/activation nodes written after them (name -> op type), and FusedConvs left alone."""

    convs: list[str] = field(default_factory=list)
    followers: dict[str, str] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)
    # For the static quantizer: follower op types it must be told to quantize, and the other nodes of those
    # types (they were not asked for: quantizing a follower is what turns the un-fused group into INT8 kernels).
    extra_ops: list[str] = field(default_factory=list)
    extra_exclude: list[str] = field(default_factory=list)


def unfuse_convs(model: Any, ops: list[str]) -> UnfusedConvs:
    """Write each com.microsoft.FusedConv of `model` back as Conv [+ Add of its Z input] [+ its activation], in
    place and exactly (FusedConv computes activation(W * x + b + Z)), when Conv is among the op types to quantize.

    Why un-fuse here, rather than keep fusion and quantization apart some other way: the INT8 form of a fused
    Conv + Relu (+ Add) is ORT's QLinearConv (+ QLinearAdd), whose output range absorbs the Relu, and ORT builds
    it from exactly the Conv -> Add -> Relu that QDQ quantization marks, never from a FusedConv. Q/DQ around the
    FusedConv itself would keep its FP32 kernel and only add conversions around it; leaving it out leaves the
    convolutions, nearly all of a CNN's work, in FP32. Doing it in the quantize pass (rather than in `fuse` when
    a quantization follows) keeps every stage true to its name: the fuse stage is still measured with its FP32
    FusedConv, and a graph fused anywhere else composes the same way."""
    out = UnfusedConvs()
    if "Conv" not in ops:
        return out
    graph = model.graph
    opset = _opset(model)
    taken = _names(graph)
    nodes: list[Any] = []
    for node in graph.node:
        if node.op_type != "FusedConv" or node.domain != MS:
            nodes.append(node)
            continue
        written = _unfuse_one(node, opset, taken, graph)
        if written is None:
            out.kept.append(node.name)
            nodes.append(node)
            continue
        out.convs.append(node.name)
        out.followers.update({n.name: n.op_type for n in written[1:]})
        nodes.extend(written)
    del graph.node[:]
    graph.node.extend(nodes)
    out.extra_ops = sorted({t for t in out.followers.values() if t in INT8_FOLLOWERS} - set(ops))
    out.extra_exclude = [n.name for n in graph.node if n.op_type in out.extra_ops and n.name not in out.followers]
    return out


def _names(graph: Any) -> set[str]:
    names = {n.name for n in graph.node} | {t.name for t in graph.initializer} | {i.name for i in graph.input}
    return names | {t for n in graph.node for t in [*n.input, *n.output]}


def _unfuse_one(node: Any, opset: int, taken: set[str], graph: Any) -> list[Any] | None:
    """[Conv, (Add), (activation)] for one FusedConv, or None when its activation has no standard form here."""
    from onnx import helper

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    kind = attrs.pop("activation", None)
    kind = kind.decode() if isinstance(kind, bytes) else kind
    params = [float(p) for p in attrs.pop("activation_params", [])]
    if kind is not None and FUSED_ACTIVATIONS.get(kind) != len(params):
        return None
    x, w = node.input[0], node.input[1]
    b = node.input[2] if len(node.input) > 2 else ""
    z = node.input[3] if len(node.input) > 3 else ""
    steps = [("Add", z)] if z else []
    steps += [(kind, "")] if kind else []
    conv_out = unique_name(f"{node.name}_conv", taken) if steps else node.output[0]
    written = [helper.make_node("Conv", [x, w, *([b] if b else [])], [conv_out], name=node.name, **attrs)]
    current = conv_out
    for i, (op, other) in enumerate(steps):
        out = node.output[0] if i == len(steps) - 1 else unique_name(f"{node.name}_sum", taken)
        name = unique_name(f"{node.name}_{op.lower()}", taken)
        if op == "Add":
            written.append(helper.make_node("Add", [current, other], [out], name=name))
        else:
            written.append(_activation(op, params, current, out, name, opset, taken, graph))
        current = out
    for new in written:
        new.metadata_props.extend(node.metadata_props)  # the module each node came from stays known
    return written


def _activation(
    op: str, params: list[float], x: str, y: str, name: str, opset: int, taken: set[str], graph: Any
) -> Any:
    import numpy as np
    from onnx import helper, numpy_helper

    if op == "LeakyRelu":
        return helper.make_node(op, [x], [y], name=name, alpha=params[0])
    if op == "HardSigmoid":
        return helper.make_node(op, [x], [y], name=name, alpha=params[0], beta=params[1])
    if op == "Clip" and opset < 11:
        return helper.make_node(op, [x], [y], name=name, min=params[0], max=params[1])
    if op == "Clip":  # from opset 11 the bounds are inputs
        bounds = [unique_name(f"{name}_{end}", taken) for end in ("min", "max")]
        graph.initializer.extend(numpy_helper.from_array(np.float32(v), n) for v, n in zip(params, bounds, strict=True))
        return helper.make_node(op, [x, *bounds], [y], name=name)
    return helper.make_node(op, [x], [y], name=name)


# Per-channel QDQ (int8_static) writes DequantizeLinear's `axis`, an opset-13 attribute; ORT's quantizer lifts
# older graphs only to opset 11 (below 10) or not at all (10-12), and then writes a graph ORT refuses to load.
PER_CHANNEL_QDQ_OPSET = 13


@contextmanager
def quantizer_input(
    src: Path, work: Path, ops: list[str], per_channel_qdq: bool
) -> Iterator[tuple[Path, UnfusedConvs]]:
    """What ORT's INT8 quantizers can take: `src` itself, or a copy at `work` (deleted afterwards) with its
    FusedConv nodes un-fused (unfuse_convs) and, for per-channel QDQ, its opset lifted to 13."""
    from onnx import version_converter

    from optimizer.runtime import onnx_io

    graph_only = onnx_io.load(src, with_weights=False)
    fused = "Conv" in ops and any(n.op_type == "FusedConv" and n.domain == MS for n in graph_only.graph.node)
    lift = per_channel_qdq and _opset(graph_only) < PER_CHANNEL_QDQ_OPSET
    if not fused and not lift:
        yield src, UnfusedConvs()
        return
    model = onnx_io.load(src)
    unfused = unfuse_convs(model, ops)
    if lift:
        model = version_converter.convert_version(model, PER_CHANNEL_QDQ_OPSET)
    written = onnx_io.save(model, work)
    try:
        yield work, unfused
    finally:
        for f in [work, *(work.parent / name for name in written)]:
            f.unlink(missing_ok=True)


def _opset(model: Any) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


# ------------------------------------------------------------------ a quantization with nothing to quantize
# What ORT's dynamic quantizer takes only from an initializer (it declines the node otherwise): MatMul's B (the
# `MatMulConstBOnly` option quantize_dynamic turns on) and Gather's data. Input index by op type.
DYNAMIC_CONST_INPUT = {"MatMul": 1, "Gather": 0}
# Op types whose nodes mean a tensor is quantized (ORT's QDQ and QOperator forms, dynamic kernels included).
QUANTIZED_OPS = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "DynamicQuantizeLinear",
        "MatMulInteger",
        "ConvInteger",
        "DynamicQuantizeMatMul",
        "MatMulIntegerToFloat",
        "QAttention",
        "QGemm",
        "DynamicQuantizeLSTM",
        "QEmbedLayerNormalization",
    }
)


def quantized_op_count(model: Any) -> int:
    return sum(n.op_type in QUANTIZED_OPS or n.op_type.startswith("QLinear") for n in model.graph.node)


def _listed(names: list[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def nothing_to_quantize(model: Any, mode: str, ops: list[str], exclude: list[str]) -> str | None:
    """Why `mode` would quantize no node of `model` (ORT's quantizer would hand the graph back unchanged), or
    None. It errs towards None: the pass also counts what its output really quantized (quantized_op_count)."""
    wanted = (set(ops) - {"Attention"}) if mode == "int8_static" else (set(ops) & DYNAMIC_OPS)
    if not wanted:
        return f"{mode} quantizes none of op_types {ops}" + (
            f" (dynamic quantization takes {sorted(DYNAMIC_OPS)})" if mode == "int8_dynamic" else ""
        )
    typed = [n for n in model.graph.node if _as_quantized(n) in wanted]
    names = " / ".join(sorted(wanted))
    if not typed:
        return f"no {names} node in the graph (op_types {ops})"
    candidates = [n for n in typed if n.name not in exclude]
    if not candidates:
        return f"every {names} node is in exclude_nodes"
    if mode != "int8_dynamic":
        return None
    inits = {t.name for t in model.graph.initializer}
    blocked = [
        n
        for n in candidates
        if n.op_type in DYNAMIC_CONST_INPUT
        and (len(n.input) <= DYNAMIC_CONST_INPUT[n.op_type] or n.input[DYNAMIC_CONST_INPUT[n.op_type]] not in inits)
    ]
    if len(blocked) < len(candidates):
        return None
    names = _listed([n.name or n.op_type for n in blocked])
    return (
        f"the weights of {names} are not initializers (a node computes them) and ORT's dynamic quantizer takes "
        "only initializer weights; a `fuse` stage before it folds constant subgraphs into initializers"
    )


def _as_quantized(node: Any) -> str:
    """The op type the quantizer will see: a FusedConv is un-fused into a Conv first (unfuse_convs)."""
    return "Conv" if node.op_type == "FusedConv" and node.domain == MS else node.op_type
