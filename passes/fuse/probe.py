"""Probe run: the input graph evaluated once on a small input, with every intermediate tensor as an output.

Rules use it for what the graph's static types do not say: ranks and shapes (SkipLayerNormalization needs two
same-shape 3-D inputs; Gemm needs a 2-D input), head counts, and what an attention mask really is. The probe
input has batch 2 and a short sequence, and the second row's attention mask pads its last tokens, so padding
and causal masks look different from each other and from no mask at all.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from optimizer.recipe.schema import InputSpec, Recipe, Scenario
from optimizer.runtime import onnx_io

PROBE_BATCH, PROBE_SEQ, PADDED = 2, 8, 3


def mask_input_name(graph: gs.Graph) -> str | None:
    """The 2-D attention-mask graph input, if there is one."""
    cands = [t for t in graph.inputs if "mask" in t.name.lower() and t.shape is not None and len(t.shape) == 2]
    cands.sort(key=lambda t: t.name != "attention_mask")
    return cands[0].name if cands else None


def probe_feed(graph: gs.Graph, recipe: Recipe) -> dict[str, np.ndarray]:
    from optimizer.runtime.inputs import _generate

    scen = recipe.scenarios[0]
    probe = Scenario(name="probe", batch=PROBE_BATCH, seq=PROBE_SEQ, dims=scen.dims)
    specs = {s.name: s for s in recipe.inputs}
    rng = np.random.default_rng(0)
    mask_name = mask_input_name(graph)
    feed: dict[str, np.ndarray] = {}
    for t in graph.inputs:
        spec = specs.get(t.name) or InputSpec(name=t.name, dtype="int64", shape=["batch", "seq"], range=(0, 100))
        if t.name == mask_name:
            spec = spec.model_copy(update={"fill": "ones"})
        value = _generate(spec, probe, rng)
        if spec.fill == "random" and np.issubdtype(value.dtype, np.integer) and "type" in t.name:
            value = np.zeros_like(value)  # token type ids: 0 is valid for every model
        feed[t.name] = value
    if mask_name:
        feed[mask_name][1, -PADDED:] = 0
    return feed


def run_probe(graph: gs.Graph, recipe: Recipe) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(feed, values of every intermediate tensor with a known dtype) on the recipe's probe input."""
    feed = probe_feed(graph, recipe)
    return feed, probe_values(graph, feed)


def probe_values(graph: gs.Graph, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Evaluate the graph on `feed` with every intermediate tensor as an extra output."""
    from optimizer.runtime.sessions import ort_session

    g = graph.copy()
    extra = [
        t
        for t in g.tensors().values()
        if isinstance(t, gs.Variable) and t.dtype is not None and t not in g.inputs and t.inputs
    ]
    g.outputs = list({t.name: t for t in [*g.outputs, *extra]}.values())
    for t in g.outputs:
        t.shape = None  # a probe at another shape must not trip over recorded static shapes
    model = gs.export_onnx(g)
    _add_contrib_opset(model)
    with tempfile.TemporaryDirectory() as tmp:
        if onnx_io.needs_external_data(model):  # too big for one in-memory message
            onnx_io.save(model, Path(tmp) / "probe.onnx")
            source: Any = Path(tmp) / "probe.onnx"
        else:
            source = model.SerializeToString()
        # Optimizations off (the probe reads the graph's own tensors); threads 0: ORT's default.
        session = ort_session(source, {"graph_optimization_level": "disable_all"}, 0)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {i.name: feed[i.name] for i in session.get_inputs()}), strict=True))


def _add_contrib_opset(model: Any) -> None:
    domains = {o.domain for o in model.opset_import}
    used = {n.domain for n in model.graph.node if n.domain not in ("", "ai.onnx")}
    for d in used - domains:
        model.opset_import.append(onnx.helper.make_opsetid(d, 1))


add_contrib_opset = _add_contrib_opset
