"""TensorRT optimization profiles from the recipe's scenarios (pure logic, tested on the CPU).

For each input, every dim bound by a scenario gets min = the smallest value any scenario uses, max = the
largest, opt = the value of the first scenario (the recipe's primary one); fixed dims are the same in all
three. One profile then serves every scenario, and an engine built from it accepts exactly those shapes.
"""

from __future__ import annotations

from typing import Any

Shape = tuple[int, ...]


def derive_profiles(
    input_shapes: dict[str, list[int | str]], scenarios: list[dict[str, int]]
) -> dict[str, dict[str, Shape]]:
    """input name -> {"min", "opt", "max"} shapes. `scenarios` are dim bindings ({"batch": 1, "seq": 128})."""
    if not scenarios:
        raise ValueError("no scenarios to derive profiles from")
    out: dict[str, dict[str, Shape]] = {}
    for name, dims in input_shapes.items():
        lo, opt, hi = [], [], []
        for d in dims:
            if isinstance(d, int):
                lo.append(d), opt.append(d), hi.append(d)
                continue
            values = [s[d] for s in scenarios if d in s]
            if not values:
                raise ValueError(f"input {name!r}: dim {d!r} is not bound by any scenario")
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
