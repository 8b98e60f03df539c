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


def asymmetric_qdq_reason(model: Any) -> str | None:
    """TensorRT takes only symmetric signed INT8 Q/DQ (zero point 0, int8). The first Q/DQ node that is not, as a
    reason; None when every one is (or there are none)."""
    from onnx import TensorProto, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    consts = {
        n.output[0]: n.attribute[0].t for n in model.graph.node if n.op_type == "Constant" and n.attribute
    }
    for node in model.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        if len(node.input) < 3 or not node.input[2]:
            return f"{node.op_type} {node.name!r} has no zero point (uint8 by default); TensorRT takes only int8"
        zp = inits.get(node.input[2]) or consts.get(node.input[2])
        if zp is None:
            continue  # computed at run time: TensorRT's parser will say
        if zp.data_type != TensorProto.INT8:
            kind = TensorProto.DataType.Name(zp.data_type).lower()
            return (
                f"{node.op_type} {node.name!r} quantizes to {kind}; TensorRT takes only symmetric signed INT8 "
                "(quantize with symmetric_activations: true, the default for cuda targets)"
            )
        if numpy_helper.to_array(zp).any():
            return f"{node.op_type} {node.name!r} has a non-zero zero point; TensorRT takes only symmetric INT8"
    return None
