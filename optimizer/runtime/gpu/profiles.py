"""TensorRT optimization profiles from the recipe's scenarios (pure logic, tested on the CPU).

For each input, every dim bound by a scenario gets min = the smallest value any scenario uses, max = the
largest, opt = the value of the first scenario (the recipe's primary one); fixed dims are the same in all
three. One profile then serves every scenario, and an engine built from it accepts exactly those shapes.
"""

from __future__ import annotations

from typing import Any

from optimizer.core.errors import InputError

Shape = tuple[int, ...]


def derive_profiles(
    input_shapes: dict[str, list[int | str]], scenarios: list[dict[str, int]]
) -> dict[str, dict[str, Shape]]:
    """input name -> {"min", "opt", "max"} shapes. `scenarios` are dim bindings ({"batch": 1, "seq": 128})."""
    if not scenarios:
        raise InputError("no scenarios to derive profiles from")
    out: dict[str, dict[str, Shape]] = {}
    for name, dims in input_shapes.items():
        lo, opt, hi = [], [], []
        for d in dims:
            if isinstance(d, int):
                lo.append(d), opt.append(d), hi.append(d)
                continue
            values = [s[d] for s in scenarios if d in s]
            if not values:
                raise InputError(f"input {name!r}: dim {d!r} is not bound by any scenario")
            lo.append(min(values)), opt.append(scenarios[0].get(d, values[0])), hi.append(max(values))
        out[name] = {"min": tuple(lo), "opt": tuple(opt), "max": tuple(hi)}
    return out


def precision_summary(op_types: dict[str, int], float16_initializers: int) -> str:
    """What precision a strongly typed engine will run, read from the graph it was built from."""
    if op_types.get("QuantizeLinear") or op_types.get("DequantizeLinear"):
        return "int8 (explicit Q/DQ) with the rest as typed in the graph"
    if float16_initializers:
        return "fp16 (as typed in the graph)"
    return "fp32 (as typed in the graph)"


CONTROL_FLOW = ("If", "Loop", "Scan")


def cuda_graph_blockers(op_types: dict[str, Any]) -> list[str]:
    """Ops that make a graph uncapturable (data-dependent control flow)."""
    return [op for op in CONTROL_FLOW if op_types.get(op)]


# The quantized types TensorRT's Q/DQ takes (its "Working with Quantized Types"), all symmetric (zero point 0):
# INT8, INT4 (weight-only), FP8 E4M3 (the H100's; what ModelOpt emits) and FP4 E2M1.
TENSORRT_QDQ_TYPES = ("INT8", "INT4", "FLOAT8E4M3FN", "FLOAT4E2M1")


def asymmetric_qdq_reason(model: Any) -> str | None:
    """TensorRT takes only symmetric Q/DQ (zero point 0) of INT8, INT4, FP8 E4M3 or FP4 E2M1. The first Q/DQ node
    that is not, as a reason; None when every one is (or there are none). Without a zero point the quantized type
    is QuantizeLinear's output_dtype (uint8 by default) or, for DequantizeLinear, the type of what it reads."""
    from onnx import TensorProto, numpy_helper

    name_of = TensorProto.DataType.Name
    inits = {t.name: t for t in model.graph.initializer}
    consts = {
        n.output[0]: n.attribute[0].t for n in model.graph.node if n.op_type == "Constant" and n.attribute
    }
    typed = {v.name: v.type.tensor_type.elem_type
             for v in [*model.graph.value_info, *model.graph.input, *model.graph.output]
             if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}
    producers = {o: n for n in model.graph.node for o in n.output}

    def quantized_type(node: Any, depth: int = 0) -> int | None:
        """The element type a Q produces or a DQ reads; None when it cannot be told from the graph."""
        if len(node.input) >= 3 and node.input[2]:
            zp = inits.get(node.input[2]) or consts.get(node.input[2])
            if zp is not None:
                return int(zp.data_type)
        if node.op_type == "QuantizeLinear":
            for a in node.attribute:
                if a.name == "output_dtype" and a.i:
                    return int(a.i)
            return TensorProto.UINT8
        x = node.input[0]
        if x in inits or x in consts:
            return int((inits.get(x) or consts[x]).data_type)
        if x in typed:
            return typed[x]
        producer = producers.get(x)
        if producer is not None and producer.op_type == "QuantizeLinear" and depth < 2:
            return quantized_type(producer, depth + 1)
        return None

    for node in model.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        kind = quantized_type(node)
        if kind is None:
            continue  # computed at run time: TensorRT's parser will say
        if kind == TensorProto.INT32 and node.op_type == "DequantizeLinear":
            return (
                f"DequantizeLinear {node.name!r} dequantizes an int32 tensor (a bias quantized by ORT's QuantizeBias); "
                "TensorRT takes no int32 Q/DQ: quantize int8_static for a cuda target, which keeps biases in float"
            )
        if name_of(kind) not in TENSORRT_QDQ_TYPES:
            advice = (" (quantize with symmetric_activations: true, the default for cuda targets)"
                      if kind == TensorProto.UINT8 else "")
            return (
                f"{node.op_type} {node.name!r} quantizes to {name_of(kind).lower()}; TensorRT takes only symmetric "
                f"{', '.join(t.lower() for t in TENSORRT_QDQ_TYPES)}{advice}"
            )
        zp = (inits.get(node.input[2]) or consts.get(node.input[2])) if len(node.input) >= 3 and node.input[2] else None
        if zp is not None and numpy_helper.to_array(zp).astype("float64").any():
            return f"{node.op_type} {node.name!r} has a non-zero zero point; TensorRT takes only symmetric Q/DQ"
    return None
