"""The plain quantization modes, each a thin layer over onnxruntime.quantization / ORT's float16 converter.

int8_dynamic: weights INT8 ahead of time (per channel optionally), activations quantized at run time per
  tensor; ORT fuses the result into DynamicQuantizeMatMul / QAttention kernels (VNNI on x86).
int8_static:  QDQ format (QuantizeLinear/DequantizeLinear around each quantized op) with activation ranges
  from calibration (MinMax, Entropy or Percentile): the explicit-quantization form TensorRT 10/11 take.
fp16:         every float tensor and op in FP16 except the op types / nodes on the block lists; with
  keep_io_types the model's inputs and outputs stay FP32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optimizer.core.quiet import quiet

DEFAULT_OPS = ["MatMul", "Attention", "Gemm", "Conv"]
# What onnxruntime's dynamic quantizer rewrites (it leaves Gemm alone: that is for the static modes).
DYNAMIC_OPS = {"MatMul", "Attention", "Conv", "Gather", "LSTM", "EmbedLayerNormalization"}


def int8_dynamic(
    src: Path, dst: Path, per_channel: bool, ops: list[str], nodes: list[str] | None, exclude: list[str]
) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with quiet():
        quantize_dynamic(
            str(src),
            str(dst),
            per_channel=per_channel,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=ops,
            nodes_to_quantize=nodes or [],
            nodes_to_exclude=exclude,
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
) -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    calibrate = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[method]
    extra = {"ActivationSymmetric": symmetric_activations, "WeightSymmetric": True, "CalibPercentile": percentile}
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
