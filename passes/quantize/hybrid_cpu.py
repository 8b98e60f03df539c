"""The hybrid mode on cpu targets: the accuracy budget and metric from the recipe and the pass's settings, the INT8-set
search (hybrid.py) on calibration inputs, the techniques tried on its choice (variants.py), the chosen graph written
to `dst`, and the search's record beside it (sensitivity.json, hybrid_search.json); returns the stage's notes. cuda
and tensorrt targets take hybrid_gpu.py instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from optimizer.core.artifact import Artifact
from optimizer.core.pass_base import PassContext
from optimizer.recipe.schema import recipe_metric
from passes.quantize.config import QuantizeConfig


def run(src: Path, dst: Path, artifact: Artifact, ctx: PassContext, cfg: QuantizeConfig) -> dict[str, object]:
    """Hybrid INT8/FP32 of `src` (the pass's input, nodes named) into `dst`, under cfg.hybrid.min_cosine or the
    recipe's cosine budget; the notes: budget, calibration, decision, INT8 and FP32 nodes, search points, timings."""
    from optimizer.runtime import onnx_io
    from optimizer.runtime.cpu_features import int8_reduce_range
    from passes.quantize import hybrid, modes
    from passes.quantize.calibration import calibration_feeds

    budget = cfg.hybrid.min_cosine
    metric = recipe_metric(ctx.recipe)
    if metric not in ("cosine", "pooled_cosine"):
        metric = "cosine"
    if budget is None:
        acc = ctx.recipe.accuracy
        budget = acc.min if recipe_metric(ctx.recipe) in ("cosine", "pooled_cosine") and acc.min else 0.99
    progress = ctx.progress
    feeds, info = calibration_feeds(ctx.recipe, cfg.calibration.samples, progress)
    # Candidates are timed on the first scenario's calibration inputs (the shape "best" leads with).
    n_scen = len(ctx.recipe.scenarios)
    timing_feeds = [f for i, f in enumerate(feeds) if i % n_scen == 0]
    graph_only = onnx_io.load(src, with_weights=False)
    scopes = onnx_io.node_scopes(graph_only)
    nodes = [n for n in modes.quantizable_nodes(graph_only, cfg.op_types) if n not in cfg.exclude_nodes]
    evaluator = hybrid.Evaluator(src, feeds, timing_feeds, ctx, artifact.runtime, metric)
    state = hybrid.Search(
        budget=budget,
        margin=cfg.hybrid.margin,
        choose=cfg.hybrid.choose,
        speed_tolerance=cfg.hybrid.speed_tolerance,
    )
    work = ctx.stage_dir / "search"
    work.mkdir()
    chosen = hybrid.search(src, work, nodes, evaluator, state, cfg.per_channel, cfg.op_types, progress)
    techniques: list[dict[str, object]] = []
    form = "dynamic"
    if cfg.smooth is not None or cfg.hybrid.candidates:
        from passes.quantize import variants

        start = variants.Choice(work / "chosen.onnx" if chosen else src, src, chosen)
        start.cosine = next((p["cosine"] for p in state.points if p["int8_nodes"] == len(chosen)), 1.0)
        final, techniques = variants.improve(start, nodes, evaluator, state, cfg, feeds, work, ctx, progress)
        variants.write(final, src, dst)
        chosen, form = final.int8, final.form
    elif chosen:
        shutil.copyfile(work / "chosen.onnx", dst)
    else:
        onnx_io.copy_model(src, dst)  # with its external data: an ONNX source keeps its weights beside it
    shutil.rmtree(work)
    table = sorted(
        (
            {
                "node": n,
                "module": scopes.get(n, "?"),
                "sensitivity": s,
                "precision": "int8" if n in chosen else "fp32",
            }
            for n, s in state.sensitivity.items()
        ),
        key=lambda r: -r["sensitivity"],
    )
    (ctx.stage_dir / "sensitivity.json").write_text(json.dumps(table, indent=1))
    search_record = {
        "metric": f"{metric} on kept positions, worst calibration sample",
        "budget": budget,
        "margin": cfg.hybrid.margin,
        "accuracy_points": state.points,
        "timings": state.timings,  # each set vs the FP32 input, interleaved: speedup, 95% interval, P50s
        "decision": state.decision,
        # smoothing, static activations, INT8 attention core: one line each, its accuracy, speed and gain
        "techniques": techniques,
        "form": form,
    }
    (ctx.stage_dir / "hybrid_search.json").write_text(json.dumps(search_record, indent=1))
    verdict = (
        f"{len(chosen)} of {len(nodes)} nodes INT8, the rest FP32 ({state.decision})"
        if chosen
        else f"no INT8 set met {metric} >= {budget} + margin {cfg.hybrid.margin}: every node kept in FP32"
    )
    return {
        "budget_cosine": budget,
        "margin": cfg.hybrid.margin,
        "calibration": info,
        "decision": verdict,
        "int8_nodes": chosen,
        "fp32_nodes": [n for n in nodes if n not in chosen],
        "most_sensitive": table[:5],
        "search_points": state.points,
        "timings": state.timings,
        "form": form,
        "techniques": [
            {k: t[k] for k in ("technique", "kept", "why", "int8_nodes", "gain") if k in t} for t in techniques
        ],
        "files": ["sensitivity.json", "hybrid_search.json"],
        "reduce_range": dict(zip(("on", "why"), int8_reduce_range(), strict=True)),
    }
