"""Techniques the hybrid search tries on top of its chosen INT8 set, each kept only when it is within the budget
and measured faster (ctx.time, against the same FP32 input as every set), each recorded as its own line of
hybrid_search.json with its accuracy and its speed against what it was tried on (the two timed head to head,
interleaved by the harness: the gain with its 95% interval and both P50s):

- smooth:          activation smoothing (smooth.py) of the nodes the search had to keep in FP32, then the largest
                   prefix of them (least sensitive first) that is INT8 within budget on the smoothed graph;
- static:          the same INT8 set with calibrated (static QDQ) activations for its MatMuls instead of dynamic
                   ranges; its Attention nodes stay dynamic (QAttention: ORT has no QDQ form of it on the CPU);
- attention_core:  the same set with its Attention nodes written back as MatMuls (attention.py) and QK^T and
                   probabilities x V quantized too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.metrics import TimedComparison
from optimizer.core.pass_base import PassContext
from passes.quantize import attention, modes, smooth
from passes.quantize.calibration import FeedReader
from passes.quantize.hybrid import Evaluator, Search


@dataclass
class Choice:
    """What the stage would write now: a model, the graph it was quantized from, its INT8 nodes and their form."""

    path: Path
    base: Path
    int8: list[str]
    form: str = "dynamic"
    cosine: float = 1.0


def smooth_file(
    src: Path, dst: Path, nodes: list[str], alpha: float, feeds: list[dict[str, Any]], ctx: PassContext, runtime: dict
) -> list[dict[str, Any]]:
    """A smoothed copy of `src` at `dst` (scales from `feeds`, run through ctx.session); one record per group."""
    from optimizer.runtime import onnx_io

    model = onnx_io.load(src)
    found = smooth.groups(model, nodes)
    probe_path = dst.parent / f"{dst.stem}_probe.onnx"

    def run(probe: Any) -> Iterator[list[Any]]:
        written = onnx_io.save(probe, probe_path)
        try:
            with ctx.session(Artifact("onnx", probe_path, dict(runtime))) as session:
                for feed in feeds:
                    yield list(session.to_numpy(session.run(session.prepare(feed))))
        finally:
            for f in [probe_path, *(probe_path.parent / w for w in written)]:
                f.unlink(missing_ok=True)

    absmax = smooth.activation_absmax(model, [g.tensor for g in found], run) if found else {}
    records = smooth.apply(model, absmax, found, alpha)
    onnx_io.save(model, dst)
    return records


def _line(
    technique: str, tried: Choice, current: Choice, kept: bool, why: str, versus: TimedComparison | None = None,
    **extra: Any,
) -> dict[str, Any]:
    line: dict[str, Any] = {"technique": technique, "int8_nodes": len(tried.int8), "cosine": tried.cosine}
    line["previous"] = {"form": current.form, "int8_nodes": len(current.int8), "cosine": current.cosine}
    if versus is not None:  # tried (p50_ms) against previous (input_p50_ms), interleaved
        line["vs_previous"] = versus.to_json(exclude={"in_run_low", "in_run_high", "instance_sd", "rounds"})
        line["gain"] = versus.ratio
    return {**line, **extra, "kept": kept, "why": why}


def _versus(evaluator: Evaluator, tried: Path, current: Path) -> TimedComparison:
    """`tried` timed against `current` by the harness (ctx.time), interleaved, on the search's timing inputs."""

    def art(path: Path) -> Artifact:
        return Artifact("onnx", path, dict(evaluator.runtime))

    return evaluator.ctx.time(art(tried), art(current), evaluator.timing_feeds)


def improve(
    current: Choice,
    nodes: list[str],
    evaluator: Evaluator,
    state: Search,
    cfg: Any,
    feeds: list[dict[str, Any]],
    work: Path,
    ctx: PassContext,
    progress: Any,
) -> tuple[Choice, list[dict[str, Any]]]:
    """Try smoothing (when cfg.smooth) and cfg.hybrid.candidates on `current`; the final choice and the lines."""
    lines: list[dict[str, Any]] = []
    target = state.budget + state.margin
    if cfg.smooth is not None:
        current = _try_smooth(current, nodes, evaluator, state, cfg, feeds, work, ctx, lines, target)
    for i, name in enumerate(cfg.hybrid.candidates):
        progress("trying INT8 forms", i + 1, len(cfg.hybrid.candidates))
        if not current.int8:
            lines.append({"technique": name, "kept": False, "why": "no INT8 node chosen to try it on"})
            continue
        path = work / f"{name}.onnx"
        form = _build_static if name == "static" else _build_attention_core
        extra = form(current, path, cfg, feeds, ctx)
        tried = Choice(path, current.base, current.int8, name)
        tried.cosine = evaluator.accuracy(path)["cosine"]
        if tried.cosine < target:
            lines.append(_line(name, tried, current, False, f"cosine {tried.cosine:.10f} < {target:.10f}", **extra))
            continue
        versus = _versus(evaluator, path, current.path)
        faster = versus.low > 1.0  # faster at 95% confidence: within noise keeps the simpler form
        why = f"within budget, {versus.ratio:.3f}x the {current.form} set" + (
            "" if faster else ": not faster at 95% confidence"
        )
        lines.append(_line(name, tried, current, faster, why, versus, **extra))
        if faster:
            current = tried
    return current, lines


def _try_smooth(
    current: Choice,
    nodes: list[str],
    evaluator: Evaluator,
    state: Search,
    cfg: Any,
    feeds: list[dict[str, Any]],
    work: Path,
    ctx: PassContext,
    lines: list[dict[str, Any]],
    target: float,
) -> Choice:
    held = sorted((n for n in nodes if n not in current.int8), key=lambda n: state.sensitivity.get(n, 0.0))
    if not held:
        lines.append({"technique": "smooth", "kept": False, "why": "no node held in FP32: nothing for it to win"})
        return current
    smoothed = work / "smoothed.onnx"
    # Every node by default, not only the held ones: the error the budget sees is the sum over all layers
    # (MiniLM: smoothing only the 2 held nodes left 24 INT8 nodes at 0.9893 on the search inputs).
    targets = [n for n in (cfg.smooth.nodes or nodes) if n in nodes]
    records = smooth_file(current.base, smoothed, targets, cfg.smooth.alpha, feeds, ctx, evaluator.runtime)
    tried: dict[int, Choice] = {}

    def attempt(m: int) -> bool:
        if m not in tried:
            path = work / f"smooth_{m}.onnx"
            modes.int8_dynamic(smoothed, path, cfg.per_channel, cfg.op_types, current.int8 + held[:m], [])
            tried[m] = Choice(path, smoothed, current.int8 + held[:m], "smooth")
            tried[m].cosine = evaluator.accuracy(path)["cosine"]
        return tried[m].cosine >= target

    lo, hi = 0, len(held)  # invariant: lo more nodes meet the target (0: none tried yet), hi unknown
    if attempt(hi):
        lo = hi
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if attempt(mid) else (lo, mid)
    extra = {"alpha": cfg.smooth.alpha, "smoothed_nodes": targets, "groups": records, "held_in_fp32_before": held}
    if lo == 0:
        best = tried[min(tried)]
        why = f"no held node became INT8 within budget (cosine {best.cosine:.10f} < {target:.10f})"
        lines.append(_line("smooth", best, current, False, why, **extra))
        return current
    choice = tried[lo]
    versus = _versus(evaluator, choice.path, current.path)
    faster = versus.low > 1.0  # faster at 95% confidence: within noise keeps the simpler form
    why = f"{lo} more INT8 nodes within budget, {versus.ratio:.3f}x the unsmoothed set" + (
        "" if faster else ": not faster at 95% confidence, kept the unsmoothed set"
    )
    lines.append(_line("smooth", choice, current, faster, why, versus, **extra))
    return choice if faster else current


def _build_static(current: Choice, path: Path, cfg: Any, feeds: list[dict[str, Any]], ctx: PassContext) -> dict:
    from optimizer.runtime import onnx_io

    graph = onnx_io.load(current.base, with_weights=False)
    kinds = {n.name: n.op_type for n in graph.graph.node}
    matmuls = [n for n in current.int8 if kinds.get(n) != "Attention"]
    attn = [n for n in current.int8 if kinds.get(n) == "Attention"]
    exclude = [n for n in modes.quantizable_nodes(graph, cfg.op_types) if n not in matmuls]
    # ORT's histogram calibrators need one shape: the first scenario's inputs (calibration_feeds takes them in turn).
    n_scen = len(ctx.recipe.scenarios)
    calib = [f for i, f in enumerate(feeds) if i % n_scen == 0]
    qdq = path.with_name(path.stem + "_qdq.onnx") if attn else path
    modes.int8_static(
        current.base,
        qdq,
        FeedReader(calib, ctx.feeds.input_names),
        cfg.calibration.method,
        cfg.per_channel,
        False,
        [o for o in cfg.op_types if o != "Attention"],
        exclude,
        cfg.calibration.percentile,
    )
    if attn:
        modes.int8_dynamic(qdq, path, cfg.per_channel, ["Attention"], attn, [])
        qdq.unlink()
    return {"calibration": {"method": cfg.calibration.method, "samples": len(calib)}, "dynamic_attention": attn}


def _build_attention_core(current: Choice, path: Path, cfg: Any, feeds: list[dict[str, Any]], ctx: PassContext) -> dict:
    from optimizer.runtime import onnx_io

    model = onnx_io.load(current.base)
    unfused = attention.unfuse(model, set(current.int8))
    plain = path.with_name(path.stem + "_unfused.onnx")
    onnx_io.save(model, plain)
    ops = sorted({*cfg.op_types, "MatMul"})
    modes.int8_dynamic(plain, path, cfg.per_channel, ops, current.int8 + unfused.core_nodes(), [], const_b_only=False)
    for f in plain.parent.glob(plain.name + "*"):
        f.unlink()
    return {"attention_core_int8": sorted(unfused.core), "kept_fused": unfused.kept}


def write(choice: Choice, src: Path, dst: Path) -> None:
    from optimizer.runtime import onnx_io

    onnx_io.copy_model(choice.path if choice.int8 else src, dst)  # with the external data the graph references


def preprocess(
    src: Path, dst: Path, cfg: Any, ctx: PassContext, runtime: dict
) -> tuple[Path, dict[str, Any], list[str]]:
    """For the plain INT8 modes: `src` smoothed (cfg.smooth) and/or with its Attention written back as MatMuls
    (cfg.attention_core int8, int8_dynamic only) into `dst`; (the graph to quantize, notes, attention core nodes
    to quantize too). Returns `src` itself when neither is asked."""
    from optimizer.runtime import onnx_io
    from passes.quantize.calibration import calibration_feeds

    notes: dict[str, Any] = {}
    path, core = src, []
    if cfg.smooth is not None:
        graph = onnx_io.load(src, with_weights=False)
        quantizable = modes.quantizable_nodes(graph, cfg.op_types)
        nodes = cfg.smooth.nodes or [n for n in quantizable if n not in cfg.exclude_nodes]
        feeds, info = calibration_feeds(ctx.recipe, cfg.calibration.samples, ctx.progress)
        records = smooth_file(src, dst, nodes, cfg.smooth.alpha, feeds, ctx, runtime)
        notes["smooth"] = {"alpha": cfg.smooth.alpha, "calibration": info, "groups": records}
        path = dst
    if cfg.attention_core == "int8" and cfg.mode == "int8_dynamic":
        model = onnx_io.load(path)
        unfused = attention.unfuse(model, None)
        onnx_io.save(model, dst)
        path, core = dst, unfused.core_nodes()
        notes["attention_core_int8"] = sorted(unfused.core)
        if unfused.kept:
            notes["attention_kept_fused"] = unfused.kept
    return path, notes, core
