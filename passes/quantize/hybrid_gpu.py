"""Hybrid INT8 / FP16 / FP32 per node for cuda and tensorrt targets, searched on the CPU by simulation.

Which nodes: MatMul, Gemm and Conv (of the recipe's op_types, minus exclude_nodes), weight or activation inputs
alike; every other node stays FP32. Each is measured twice on the calibration inputs, against the FP32 input
graph's own outputs on the CPU (so stage 0's reference is not needed): the cosine drop when that node alone is
INT8, and when it alone is FP16 (precision_graph.py writes both simulations, runnable by ORT's CPU provider).

The choice, under the budget plus margin (the judged output's worst sample, kept positions only, ctx.check):
  1. FP16 first: the largest prefix of the nodes whose FP16 alone keeps the budget (least sensitive per FLOP
     first) that still keeps it together; those nodes are FP16, the rest FP32. On a GPU FP32 matrix work is
     several times slower than FP16, so FP16 is the floor the INT8 search starts from, not FP32.
  2. INT8 on top: the largest prefix of the nodes whose INT8 alone keeps the budget, ordered by sensitivity per
     FLOP (least accuracy given up per unit of work moved to INT8), moved to INT8 with the rest as in 1.
  Nodes where neither FP16 nor INT8 keeps the budget stay FP32.
Speed is not measured: a GPU target's speed cannot be timed on the CPU (the CPU hybrid's speed ladder has no
meaning here), so the choice takes the most INT8 work within budget; FLOPs stand in for speed in the ordering
and the record says what share of the FLOPs each precision carries. Choosing by time needs the GPU.

The stage's graph is the deployable one (precision_graph.py, `deploy`): onnx.checker (full_check) and a type check
(no node with mixed float inputs) must pass; it is also run on the CPU when ORT's CPU provider has its FP16 kernels
(recorded either way). With a GPU here (ORT's CUDA provider), it runs there too and the real cosine is recorded
beside the simulated one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.pass_base import PassContext
from optimizer.recipe.schema import recipe_metric
from passes.quantize import precision_graph as pg

Plan = dict[str, str]
SPEED_NOTE = (
    "not timed: a cuda/tensorrt target's speed cannot be measured on the CPU, so the choice is the most INT8 "
    "work within budget (nodes ordered by sensitivity per FLOP); choosing by time needs the GPU"
)


def budget_of(ctx: PassContext, min_cosine: float | None) -> tuple[float, str]:
    metric = recipe_metric(ctx.recipe)
    metric = metric if metric in ("cosine", "pooled_cosine") else "cosine"
    if min_cosine is not None:
        return min_cosine, metric
    acc = ctx.recipe.accuracy
    return (acc.min if recipe_metric(ctx.recipe) in ("cosine", "pooled_cosine") and acc.min else 0.99), metric


def order_key(sens: dict[str, float], share: dict[str, float]) -> Callable[[str], tuple[float, float]]:
    """Least cosine given up per share of the FLOPs first; ties (sensitivity 0) by more FLOPs first."""
    return lambda n: (max(sens[n], 0.0) / max(share.get(n, 0.0), 1e-9), -share.get(n, 0.0))


def largest_prefix(order: list[str], meets: Callable[[int], bool]) -> int:
    """The largest k with meets(k) by bisection (meets(0) holds: the plan it starts from); the whole list first."""
    if not order or meets(len(order)):
        return len(order)
    lo, hi = 0, len(order)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return lo


def choose(
    nodes: list[str],
    s8: dict[str, float],
    s16: dict[str, float],
    share: dict[str, float],
    evaluate: Callable[[Plan], dict[str, float]],
    target: float,
) -> tuple[Plan, list[dict[str, Any]], dict[str, float]]:
    """The plan (node -> int8 / fp16 / fp32), every accuracy point tried, and the chosen plan's accuracy."""
    points: list[dict[str, Any]] = []
    seen: dict[tuple[tuple[str, str], ...], dict[str, float]] = {}

    def score(plan: Plan) -> dict[str, float]:
        key = tuple(sorted(plan.items()))
        if key not in seen:
            seen[key] = evaluate(plan)
            counts = {p: sum(v == p for v in plan.values()) for p in ("int8", "fp16")}
            points.append({**counts, **seen[key]})
        return seen[key]

    fp16_order = sorted((n for n in nodes if 1 - s16[n] >= target), key=order_key(s16, share))
    m = largest_prefix(fp16_order, lambda k: score(dict.fromkeys(fp16_order[:k], "fp16"))["cosine"] >= target)
    base: Plan = {n: "fp32" for n in nodes} | dict.fromkeys(fp16_order[:m], "fp16")
    int8_order = sorted((n for n in nodes if 1 - s8[n] >= target), key=order_key(s8, share))
    k = largest_prefix(int8_order, lambda k: score(base | dict.fromkeys(int8_order[:k], "int8"))["cosine"] >= target)
    plan = base | dict.fromkeys(int8_order[:k], "int8")
    return plan, points, score(plan)


class Simulator:
    """Writes plans as simulation graphs and scores them on the search inputs (hybrid.Evaluator, on the CPU)."""

    def __init__(self, model: Any, amax: dict[str, float], evaluator: Any, work: Path) -> None:
        self.model, self.amax, self.evaluator, self.work = model, amax, evaluator, work
        self.runs = 0

    def __call__(self, plan: Plan, name: str = "simulation.onnx") -> dict[str, float]:
        from optimizer.runtime import onnx_io

        path = self.work / name
        onnx_io.save(pg.write(self.model, plan, self.amax, simulate=True), path)
        self.runs += 1
        return self.evaluator.accuracy(path)


@dataclass
class SingleNode:
    """(INT8, FP16) sensitivity of one node alone (1 - cosine): a pure function of the input graph, the calibration
    ranges and inputs and the node, so ctx.map may run it in another process (which loads the graph itself)."""

    evaluator: Any  # hybrid.Evaluator: the input graph's path, the search inputs and its outputs on them
    amax: dict[str, float]
    work: Path
    model: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "model": None}  # a worker loads it from evaluator.src, once

    def __call__(self, ctx: PassContext, item: tuple[int, str]) -> tuple[float, float]:
        from optimizer.runtime import onnx_io

        i, node = item
        if self.model is None:
            self.model = onnx_io.load(self.evaluator.src)
        simulate = Simulator(self.model, self.amax, self.evaluator.on(ctx), self.work)
        try:
            int8, fp16 = (1 - simulate({node: p}, f"single{i}.onnx")["cosine"] for p in ("int8", "fp16"))
            return int8, fp16
        finally:
            for f in self.work.glob(f"single{i}.onnx*"):
                f.unlink()


def calibrate(
    src: Path, work: Path, feeds: list[dict[str, np.ndarray]], names: list[str], ops: list[str], method: str
) -> dict[str, float]:
    """Symmetric activation ranges (max |x|) of the planned ops' inputs and outputs, by ORT's calibrator."""
    from onnxruntime.quantization.calibrate import CalibrationMethod, create_calibrator

    from optimizer.core.quiet import quiet
    from passes.quantize.calibration import FeedReader

    kind = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[method]
    with quiet():
        calibrator = create_calibrator(
            src,
            ops,
            augmented_model_path=str(work / "augmented.onnx"),
            calibrate_method=kind,
            extra_options={"symmetric": True},
            use_external_data_format=True,
        )
        calibrator.collect_data(FeedReader(feeds, names))
        ranges = calibrator.compute_data()
    for f in work.glob("augmented.onnx*"):
        f.unlink()
    return {t: float(max(abs(np.max(d.range_value[0])), abs(np.max(d.range_value[1])))) for t, d in ranges.items()}


def shapes_of(
    model: Any, nodes: list[Any], feed: dict[str, np.ndarray], ctx: PassContext, runtime: dict[str, Any], work: Path
) -> dict[str, tuple[int, ...]]:
    """The planned nodes' input and output shapes on one feed (the FLOPs that order the search)."""
    import onnx

    from optimizer.runtime import onnx_io

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output} | {t.name for t in probe.graph.initializer}
    wanted = sorted({t for n in nodes for t in [n.input[0], *n.output] if t and t not in have})
    probe.graph.output.extend(onnx.ValueInfoProto(name=t) for t in wanted)
    path = work / "shapes.onnx"
    onnx_io.save(probe, path)
    with ctx.session(Artifact("onnx", path, dict(runtime))) as session:
        values = session.to_numpy(session.run(session.prepare(feed)))
        shapes = {n: tuple(np.shape(v)) for n, v in zip(session.output_names, values, strict=True)}
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    return shapes | inits


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def deployable_checks(dst: Path, evaluator: Any, ctx: PassContext) -> dict[str, Any]:
    """onnx.checker (full_check) and the type check must pass (a PassError otherwise); the CPU run and, with a
    GPU here, the real run are recorded."""
    import onnx

    from optimizer.runtime import gpu, onnx_io

    try:
        onnx.checker.check_model(str(dst), full_check=True)
    except Exception as e:
        raise PassError(f"hybrid (gpu): the deployable graph fails onnx.checker: {_first_line(e)}") from e
    mixed = pg.mixed_float_inputs(onnx_io.load(dst))
    if mixed:
        raise PassError(f"hybrid (gpu): nodes with mixed float input types: {'; '.join(mixed[:3])}")
    out: dict[str, Any] = {"onnx_checker": "ok (full_check)", "mixed_float_inputs": 0}
    try:
        out["cpu"] = evaluator.on(ctx).accuracy(dst, "cpu")
    except Exception as e:  # ORT's CPU provider lacks some FP16 kernels: the simulation's numbers stand
        out["cpu"] = {"not run": _first_line(e)}
    reason = gpu.ort_cuda_reason()
    if reason:
        out["gpu"] = {"not run": reason}
    else:
        out["gpu"] = {**evaluator.on(ctx).accuracy(dst, "cuda"), "on": "onnxruntime CUDAExecutionProvider"}
    return out


def run(src: Path, dst: Path, artifact: Artifact, ctx: PassContext, cfg: Any) -> dict[str, object]:
    """The hybrid for a cuda/tensorrt target: `src` (FP32) into the deployable graph at `dst`; notes for the stage
    and hybrid_search.json (see the module docstring)."""
    import shutil

    from onnx import version_converter

    from optimizer.runtime import onnx_io
    from passes.quantize import hybrid
    from passes.quantize.calibration import calibration_feeds

    budget, metric = budget_of(ctx, cfg.hybrid.min_cosine)
    target = budget + cfg.hybrid.margin
    work = ctx.stage_dir / "search"
    work.mkdir(exist_ok=True)
    model = onnx_io.load(src)
    if pg.opset(model) < pg.QDQ_OPSET:  # per-axis DequantizeLinear is opset 13
        model = version_converter.convert_version(model, pg.QDQ_OPSET)
        src = work / "input13.onnx"
        onnx_io.save(model, src)
    ops = [o for o in cfg.op_types if o in pg.PLANNED_OPS]
    planned = [n for n in model.graph.node if n.op_type in ops and n.name and n.name not in cfg.exclude_nodes]
    if not planned:
        raise PassError(f"hybrid (gpu): no node of op_types {ops} to choose a precision for")
    names = [n.name for n in planned]
    feeds, info = calibration_feeds(ctx.recipe, cfg.calibration.samples, ctx.progress)
    n_scen = len(ctx.recipe.scenarios)
    first = [f for i, f in enumerate(feeds) if i % n_scen == 0]  # histogram calibrators take one shape
    method = cfg.calibration.method
    amax = calibrate(src, work, feeds if method == "minmax" else first, ctx.feeds.input_names, ops, method)
    shapes = shapes_of(model, planned, first[0], ctx, artifact.runtime, work)
    flops = {n.name: pg.node_flops(n, shapes) for n in planned}
    total = sum(flops.values())
    share = {n: (f / total if total else 1 / len(names)) for n, f in flops.items()}

    evaluator = hybrid.Evaluator(src, feeds, [], ctx, artifact.runtime, metric)
    simulate = Simulator(model, amax, evaluator, work)
    single = SingleNode(evaluator, amax, work, model)
    both = ctx.map(single, list(enumerate(names)), "sensitivity per node (INT8, FP16)")
    s8 = {n: s[0] for n, s in zip(names, both, strict=True)}
    s16 = {n: s[1] for n, s in zip(names, both, strict=True)}
    simulate.runs += 2 * len(names)
    ctx.progress("searching precisions", 0, 0)
    plan, points, simulated = choose(names, s8, s16, share, simulate, target)

    onnx_io.save(pg.write(model, plan, amax, simulate=False), dst)
    deployable = deployable_checks(dst, evaluator, ctx)
    shutil.rmtree(work)

    counts = {p: sum(v == p for v in plan.values()) for p in ("int8", "fp16", "fp32")}
    flops_share = {p: round(sum(share[n] for n in names if plan[n] == p), 4) for p in counts}
    scopes = onnx_io.node_scopes(model)
    types = {n.name: n.op_type for n in planned}
    table = [
        {
            "node": n,
            "op_type": types[n],
            "module": scopes.get(n, "?"),
            "precision": plan[n],
            "sensitivity_int8": s8[n],
            "sensitivity_fp16": s16[n],
            "flops": flops[n],
        }
        for n in names
    ]
    real = deployable["gpu"].get("cosine")
    record = {
        "simulated_on": "cpu",
        "target": ctx.recipe.target.device,
        "metric": f"{metric} on kept positions, worst calibration sample, against the FP32 input graph on the CPU",
        "budget": budget,
        "margin": cfg.hybrid.margin,
        "calibration": {
            **info,
            "method": method,
            "activations": "symmetric per-tensor, int8 zero point 0",
            "weights": "symmetric per output channel",
        },
        "simulated": simulated,
        **({"real": real, "simulated_minus_real": simulated["cosine"] - real} if real is not None else {}),
        "counts": counts,
        "flops_share": flops_share,
        "speed": SPEED_NOTE,
        "search_points": points,
        "simulation_runs": simulate.runs,
        "deployable": deployable,
        "nodes": table,
    }
    (ctx.stage_dir / "hybrid_search.json").write_text(json.dumps(record, indent=1))
    decision = (
        f"{counts['int8']} INT8, {counts['fp16']} FP16, {counts['fp32']} FP32 of {len(names)} nodes "
        f"({flops_share['int8']:.0%} of the FLOPs in INT8); simulated {metric} {simulated['cosine']:.5f} on the CPU"
    )
    return {
        "budget_cosine": budget,
        "margin": cfg.hybrid.margin,
        "calibration": info,
        "simulated_on": "cpu",
        "simulated": simulated,
        **({"real": real} if real is not None else {}),
        "decision": decision,
        "counts": counts,
        "int8_nodes": [n for n in names if plan[n] == "int8"],
        "fp16_nodes": [n for n in names if plan[n] == "fp16"],
        "fp32_nodes": [n for n in names if plan[n] == "fp32"],
        "speed": SPEED_NOTE,
        "deployable": deployable,
        "files": ["hybrid_search.json"],
    }
