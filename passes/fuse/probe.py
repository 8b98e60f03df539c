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
    infer_dtypes(g)
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


def infer_dtypes(graph: gs.Graph) -> None:
    """Give untyped intermediate tensors the element type ONNX type inference finds for them, in place.

    Exporters differ in what they record: dynamo writes a value_info for every tensor, the TorchScript exporter
    (and Optimum, which uses it) none at all. A tensor without a dtype cannot be a probe output, so without this
    every rule that reads a probe value declines on such graphs. Inference runs on a copy whose large weights are
    typed inputs instead (no weight bytes copied, no 2 GB message limit); where it fails (an op it does not know)
    the graph is left as it was."""
    untyped = [t for t in graph.tensors().values() if isinstance(t, gs.Variable) and t.dtype is None and t.inputs]
    if not untyped:
        return
    light = graph.copy()
    for t in list(light.tensors().values()):
        if isinstance(t, gs.Constant) and int(np.prod(t.shape)) > 1024:
            weight = gs.Variable(t.name, dtype=t.dtype, shape=list(t.shape))
            for node in list(t.outputs):
                for i, x in enumerate(node.inputs):
                    if x is t:
                        node.inputs[i] = weight
            light.inputs.append(weight)
    try:
        model = onnx.shape_inference.infer_shapes(gs.export_onnx(light, do_type_check=False))
    except Exception:
        return
    known = {
        vi.name: vi.type.tensor_type.elem_type
        for vi in [*model.graph.value_info, *model.graph.output]
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type
    }
    for t in untyped:
        if t.name in known:
            t.dtype = onnx.helper.tensor_dtype_to_np_dtype(known[t.name])


def _add_contrib_opset(model: Any) -> None:
    domains = {o.domain for o in model.opset_import}
    used = {n.domain for n in model.graph.node if n.domain not in ("", "ai.onnx")}
    for d in used - domains:
        model.opset_import.append(onnx.helper.make_opsetid(d, 1))


add_contrib_opset = _add_contrib_opset
