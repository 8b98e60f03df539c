"""Activation smoothing (SmoothQuant, Xiao et al. 2023) ahead of INT8: per input channel j of a MatMul's
activation X, s_j = max|X_j|^alpha / max|W_j,:|^(1-alpha) over calibration inputs; X is divided by s and the
weight rows multiplied by s, so X W is unchanged (an exact rescaling in real arithmetic) while the activation's
outlier channels, which set a per-tensor INT8 scale for every channel, shrink.

Where X / s goes, cheapest first, always exactly:
- into the producer's affine output when the MatMuls being smoothed are its only consumers: a LayerNormalization
  or SkipLayerNormalization (gamma and beta divided by s), or a com.microsoft Attention (the V columns of its QKV
  weight and bias: channel j of the attention output is V's channel j, weighted by the probabilities);
- otherwise into a Mul by 1 / s written before the MatMuls (BERT's LayerNorm outputs are also the residual and its
  FFN-output MatMul reads a GELU: neither can take the scale without changing another consumer).

Why hand-written: ONNX Runtime's own SmoothQuant option (quantize_static extra option) runs only with static
quantization and needs Intel Neural Compressor installed; the dynamic INT8 kernels this project picks on the CPU
benefit the same way, and the rescaling is these few lines.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optimizer.core.names import unique_name

MS = "com.microsoft"
# Producers whose output is an affine map with per-channel gamma (input 1 / 2) and beta (input 2 / 3).
LAYER_NORMS = {"LayerNormalization": (1, 2), "SkipLayerNormalization": (2, 3)}
EPS = 1e-5


@dataclass
class Group:
    """The MatMuls (or fused Attention nodes) that read one activation tensor, smoothed with one scale vector."""

    tensor: str
    nodes: list[str] = field(default_factory=list)


def weight_index(node: Any) -> int | None:
    """Which input of a node holds the [in_channels, out] weight smoothing scales by row."""
    if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
        return 1
    if node.op_type == "Attention" and node.domain == MS:
        return 1
    return None


def groups(model: Any, nodes: Iterable[str]) -> list[Group]:
    """The named nodes with a constant 2-D weight, grouped by the activation they read (MatMuls sharing an input
    must share its scale)."""
    inits = {t.name: t for t in model.graph.initializer}
    wanted = set(nodes)
    out: dict[str, Group] = {}
    for node in model.graph.node:
        idx = weight_index(node)
        if node.name not in wanted or idx is None or len(node.input) <= idx:
            continue
        w = inits.get(node.input[idx])
        if w is None or len(w.dims) != 2:
            continue
        out.setdefault(node.input[0], Group(node.input[0])).nodes.append(node.name)
    return list(out.values())


def activation_absmax(
    model: Any, tensors: list[str], run: Callable[[Any], Iterable[list[np.ndarray]]]
) -> dict[str, np.ndarray]:
    """Per-channel (last axis) max |x| of each named tensor over the calibration inputs. `run(model)` runs a model
    on every calibration feed and yields its outputs; the tensors are added as outputs of a copy of `model`. Every
    position counts, padding included: a dynamic quantizer's range covers the whole tensor."""
    import onnx
    from onnx import helper

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_tensor_value_info(t, onnx.TensorProto.FLOAT, None) for t in tensors)
    found: dict[str, np.ndarray] = {}
    for outputs in run(probe):
        for name, value in zip(tensors, outputs, strict=True):
            m = np.abs(np.asarray(value, np.float32)).reshape(-1, value.shape[-1]).max(axis=0)
            found[name] = np.maximum(found[name], m) if name in found else m
    return found


def scales(x_absmax: np.ndarray, w_rowmax: np.ndarray, alpha: float) -> np.ndarray:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha), clamped away from 0 and inf (dead channels keep s = 1)."""
    x = np.maximum(x_absmax.astype(np.float64), EPS)
    w = np.maximum(w_rowmax.astype(np.float64), EPS)
    s = x**alpha / w ** (1 - alpha)
    s[(x_absmax <= EPS) | (w_rowmax <= EPS)] = 1.0
    return np.clip(s, 1e-4, 1e4).astype(np.float32)


def apply(model: Any, absmax: dict[str, np.ndarray], found: list[Group], alpha: float) -> list[dict[str, Any]]:
    """Smooth each group of `model` in place; one record per group (where the 1/s went, the activation's outlier
    ratio max/median before and after)."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    by_name = {n.name: n for n in model.graph.node}
    consumers: dict[str, list[Any]] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    producer = {o: n for n in model.graph.node for o in n.output}
    records = []
    for g in found:
        members = [by_name[n] for n in g.nodes]
        weights = [numpy_helper.to_array(inits[m.input[weight_index(m) or 1]]) for m in members]
        s = scales(absmax[g.tensor], np.max([np.abs(w).max(axis=1) for w in weights], axis=0), alpha)
        for m, w in zip(members, weights, strict=True):
            _set(model, inits, m, weight_index(m) or 1, w * s[:, None])
        readers = consumers.get(g.tensor, [])
        only_ours = all(r.name in g.nodes for r in readers)
        prod = producer.get(g.tensor)
        if prod is not None and prod.op_type == "Reshape" and len(consumers.get(prod.input[0], [])) == 1:
            # [B, S, H] -> [B, S, H] after an Attention (as exporters write it): channels pass through unchanged,
            # and a wrong guess cannot slip by: _fold checks the Attention's hidden size against len(s).
            inner = producer.get(prod.input[0])
            prod, tensor = (
                (inner, inner.output[0]) if inner is not None and inner.op_type == "Attention" else (prod, g.tensor)
            )
        else:
            tensor = g.tensor
        where = _fold(model, inits, prod, tensor, s) if only_ours else None
        if where is None:
            where = _insert_mul(model, g, s, consumers)
        x = absmax[g.tensor]
        records.append(
            {
                "tensor": g.tensor,
                "nodes": g.nodes,
                "alpha": alpha,
                "folded_into": where,
                "outlier_ratio_before": float(x.max() / max(np.median(x), EPS)),
                "outlier_ratio_after": float((x / s).max() / max(np.median(x / s), EPS)),
            }
        )
    return records


def _set(model: Any, inits: dict[str, Any], node: Any, index: int, value: np.ndarray) -> None:
    """Write `value` as input `index` of `node`: in place when only this node reads the initializer, else as a new
    initializer for this node alone."""
    from onnx import numpy_helper

    name = node.input[index]
    shared = sum(name in n.input for n in model.graph.node) > 1
    if shared:
        name = f"{name}_smoothed_{node.name}"
        node.input[index] = name
        model.graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), name))
        inits[name] = model.graph.initializer[-1]
    else:
        inits[name].CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))


def _fold(model: Any, inits: dict[str, Any], prod: Any, tensor: str, s: np.ndarray) -> str | None:
    """Divide the producer's per-channel affine output by s; the producer's name, or None when it has none."""
    from onnx import numpy_helper

    if prod is None or list(prod.output).index(tensor) != 0:
        return None
    if prod.op_type in LAYER_NORMS and prod.domain in ("", "ai.onnx", MS):
        idx = [i for i in LAYER_NORMS[prod.op_type] if i < len(prod.input) and prod.input[i]]
        if any(prod.input[i] not in inits or _size(inits[prod.input[i]]) != s.size for i in idx):
            return None
        for i in idx:
            _set(model, inits, prod, i, numpy_helper.to_array(inits[prod.input[i]]) / s)
        return prod.name
    if prod.op_type == "Attention" and prod.domain == MS and len(prod.input) > 2 and tensor == prod.output[0]:
        w, b = (inits.get(prod.input[i]) for i in (1, 2))
        hidden = s.shape[0]
        if w is None or b is None or w.dims[-1] != 3 * hidden:
            return None
        wv, bv = numpy_helper.to_array(w).copy(), numpy_helper.to_array(b).copy()
        wv[:, 2 * hidden :] /= s
        bv[2 * hidden :] /= s
        _set(model, inits, prod, 1, wv)
        _set(model, inits, prod, 2, bv)
        return prod.name
    return None


def _size(tensor: Any) -> int:
    return int(np.prod(tensor.dims)) if tensor.dims else 1


def _insert_mul(model: Any, g: Group, s: np.ndarray, consumers: dict[str, list[Any]]) -> str:
    from onnx import helper, numpy_helper

    taken = {n.name for n in model.graph.node} | {o for n in model.graph.node for o in n.output}
    # The Mul is `name` and writes `name_out`: a name is taken when either is.
    name = unique_name(f"{g.nodes[0]}_smooth", taken | {t.removesuffix("_out") for t in taken})
    model.graph.initializer.append(numpy_helper.from_array((1.0 / s).astype(np.float32), f"{name}_inv_scale"))
    mul = helper.make_node("Mul", [g.tensor, f"{name}_inv_scale"], [f"{name}_out"], name=name)
    for reader in consumers.get(g.tensor, []):
        if reader.name in g.nodes:
            reader.input[0] = f"{name}_out"
    # Before the first member, so the graph stays topologically sorted.
    first = min(i for i, n in enumerate(model.graph.node) if n.name in g.nodes)
    model.graph.node.insert(first, mul)
    return name
