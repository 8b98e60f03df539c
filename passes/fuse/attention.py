"""Self-attention -> com.microsoft.Attention (packed QKV projection, one kernel per block).

The maths: for x in R^{B x S x E}, H heads of size D = E / H,
    Q = x Wq + bq, K = x Wk + bk, V = x Wv + bv, each reshaped to [B, H, S, D];
    out = softmax(scale * Q K^T + M) V, transposed back and reshaped to [B, S, E].
Attention computes exactly this from x, W = [Wq | Wk | Wv] (E x 3E), b = [bq | bk | bv] and a mask. Merging
the three projections into one GEMM is the "QKV projection merge"; the rest becomes one fused kernel.

Matching starts at each Softmax and walks outwards, so it accepts the forms today's exporters write:
  * scale applied to the scores (eager: Div by sqrt(D)) or split over Q and K^T (SDPA: Mul by D^-1/4 each);
  * K^T as one Transpose(0,2,3,1), as Transpose(0,1,3,2) of the heads, or as the Reshape/Transpose/Reshape
    chain torch.export writes for SDPA (checked numerically to be K^T);
  * the NaN guard SDPA adds after Softmax (Where(IsNaN(p), 0, p));
  * separate Q/K/V MatMuls, or one packed MatMul split three ways (GPT-2's Conv1D).
The additive mask M is classified by evaluating the graph on a probe input (batch 2, the second row padded):
none, padding (from a 2-D attention_mask input), causal, or causal + padding. Anything else (ALiBi, relative
position bias, a 3-D mask) is left unfused, and the reason is reported per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from passes.fuse.graph import MS, const, const_tensor, name_of, producer, scalar, variable
from passes.fuse.rule import RuleReport

NEG_THRESHOLD = -1e4  # additive mask entries at or below this count as "masked"


class Decline(Exception):
    """A block does not match; the message says why."""


@dataclass
class Projection:
    x: gs.Tensor
    w: np.ndarray  # [E_in, E_out]
    b: np.ndarray  # [E_out]


@dataclass
class Block:
    name: str
    softmax: gs.Node
    q: Projection
    k: Projection
    v: Projection
    q_heads: gs.Tensor  # [B, H, S, D]: its shape gives H and D on the probe
    k_t: gs.Tensor  # the right operand of Q K^T
    k_heads: gs.Tensor | None  # [B, H, S, D] when K^T must be checked against it on the probe
    mask: gs.Tensor | None
    scale: float
    out_reshape: gs.Node
    heads: int = 0
    mask_kind: str = "none"


def _strip_scale(t: gs.Tensor) -> tuple[gs.Tensor, float]:
    """Peel Mul/Div by constant scalars off t; return the inner tensor and the accumulated factor."""
    factor = 1.0
    while True:
        node = producer(t, ("Mul", "Div"))
        if node is None:
            return t, factor
        a, b = node.inputs
        if node.op == "Mul" and scalar(b) is not None:
            factor, t = factor * scalar(b), a  # type: ignore[operator]
        elif node.op == "Mul" and scalar(a) is not None:
            factor, t = factor * scalar(a), b  # type: ignore[operator]
        elif node.op == "Div" and scalar(b) not in (None, 0.0):
            factor, t = factor / scalar(b), a  # type: ignore[operator]
        else:
            return t, factor


def _linear(t: gs.Tensor) -> Projection:
    """t = x W + b with constant W (2-D) and b (1-D): MatMul + Add, or Gemm on x flattened to 2-D (GPT-2's
    Conv1D), possibly one part of a packed projection taken by Split/Slice on the last axis."""
    split = producer(t, ("Split", "Slice"))
    src = split.inputs[0] if split is not None else t
    back = producer(src, "Reshape")  # [B*S, 3E] -> [B, S, 3E] after a Gemm
    if back is not None and producer(back.inputs[0], "Gemm") is not None:
        src = back.inputs[0]
    gemm, add = producer(src, "Gemm"), producer(src, "Add")
    if gemm is not None:
        w, x = const(gemm.inputs[1]), gemm.inputs[0]
        b = const(gemm.inputs[2]) if len(gemm.inputs) > 2 else None
        if (
            w is None
            or any(float(gemm.attrs.get(k, 1.0)) != 1.0 for k in ("alpha", "beta"))
            or gemm.attrs.get("transA", 0)
        ):
            raise Decline("projection Gemm is not a plain x W + b with constant W")
        w = w.T if gemm.attrs.get("transB", 0) else w
        flat = producer(x, "Reshape")
        x = flat.inputs[0] if flat is not None else x
        b = np.zeros(w.shape[1], w.dtype) if b is None else b
    elif add is not None:
        mm_t, bias = (add.inputs[0], add.inputs[1]) if const(add.inputs[1]) is not None else add.inputs[::-1]
        b, mm = const(bias), producer(mm_t, "MatMul")
        if mm is None:
            raise Decline("projection is not MatMul + bias")
        w, x = const(mm.inputs[1]), mm.inputs[0]
    else:
        raise Decline("projection is not MatMul + bias or Gemm")
    if w is None or w.ndim != 2 or b is None or b.ndim != 1:
        raise Decline("projection weight is not a constant 2-D matrix with a 1-D bias")
    if split is not None:
        lo, hi = _part(split, t, w.shape[1])
        w, b = w[:, lo:hi], b[lo:hi]
    return Projection(x, w, b)


def _part(node: gs.Node, out: gs.Tensor, width: int) -> tuple[int, int]:
    """Column range [start, end) of the last axis that a Split/Slice output takes."""
    if node.op == "Split":
        axis = int(node.attrs.get("axis", 0))
        if axis not in (-1, 2):
            raise Decline("packed QKV split is not on the last axis")
        i = node.outputs.index(out)
        sizes = const(node.inputs[1]) if len(node.inputs) > 1 else None
        if sizes is None:
            parts = int(node.attrs.get("num_outputs", len(node.outputs)))
            sizes = np.full(parts, width // parts)
        start = int(np.sum(sizes[:i]))
        return start, start + int(sizes[i])
    starts, ends, axes = (const(t) for t in node.inputs[1:4]) if len(node.inputs) >= 4 else (None, None, None)
    if starts is None or ends is None or axes is None or int(axes.reshape(-1)[0]) not in (-1, 2):
        raise Decline("packed QKV slice is not on the last axis with constant bounds")
    return int(starts.reshape(-1)[0]), min(int(ends.reshape(-1)[0]), width)


def _heads(t: gs.Tensor, perm: list[int]) -> Projection:
    """t = Transpose(Reshape(linear), perm): the per-head view of a projection."""
    tr = producer(t, "Transpose")
    if tr is None or list(tr.attrs.get("perm", [])) != perm:
        raise Decline(f"expected Transpose{perm} into the attention MatMul")
    rs = producer(tr.inputs[0], "Reshape")
    if rs is None:
        raise Decline("expected Reshape to heads before the Transpose")
    return _linear(rs.inputs[0])


def _key(t: gs.Tensor) -> tuple[Projection, gs.Tensor | None]:
    """K^T: Transpose(0,2,3,1) of the projection, or a Reshape/Transpose chain from the K heads."""
    try:
        return _heads(t, [0, 2, 3, 1]), None
    except Decline:
        pass
    cur = t
    for _ in range(4):
        node = producer(cur, ("Reshape", "Transpose"))
        if node is None:
            break
        cur = node.inputs[0]
        try:
            return _heads(cur, [0, 2, 1, 3]), cur  # K heads found; K^T is checked on the probe
        except Decline:
            continue
    raise Decline("could not trace K^T back to a key projection")


def split_scores(softmax: gs.Node) -> tuple[gs.Tensor, gs.Tensor, gs.Tensor | None, float]:
    """softmax(scale Q K^T + M) -> (the Q operand, the K^T operand, M or None, scale), with the scale peeled off
    the scores and off both operands (SDPA splits it over Q and K^T)."""
    axis = int(softmax.attrs.get("axis", -1))
    if axis not in (-1, 3):
        raise Decline(f"softmax axis is {axis}, not the last")
    scores, mask = softmax.inputs[0], None
    add = producer(scores, "Add")
    if add is not None:
        for cand, other in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
            inner, _ = _strip_scale(cand)
            if producer(inner, "MatMul") is not None:
                scores, mask = cand, other
                break
        else:
            raise Decline("softmax input is an Add without a Q K^T MatMul")
    inner, scale = _strip_scale(scores)
    qk = producer(inner, "MatMul")
    if qk is None:
        raise Decline("softmax input is not Q K^T")
    q_t, q_scale = _strip_scale(qk.inputs[0])
    k_t, k_scale = _strip_scale(qk.inputs[1])
    return q_t, k_t, mask, scale * q_scale * k_scale


def _match(softmax: gs.Node) -> Block:
    q_t, k_t, mask, scale = split_scores(softmax)
    q = _heads(q_t, [0, 2, 1, 3])
    k, k_heads = _key(k_t)
    # Output side: optional NaN guard, then P V, Transpose back, Reshape to [B, S, E].
    probs = softmax.outputs[0]
    users = list(probs.outputs)
    guard = next((u for u in users if u.op == "Where"), None)
    if guard is not None and {u.op for u in users} <= {"IsNaN", "Where"}:
        probs = guard.outputs[0]
    pv = next((u for u in probs.outputs if u.op == "MatMul" and u.inputs[0] is probs), None)
    if pv is None or len(probs.outputs) != 1:
        raise Decline("softmax output does not go (only) into P V")
    v = _heads(pv.inputs[1], [0, 2, 1, 3])
    if not (q.x is k.x is v.x):
        raise Decline("Q, K and V are not projections of one input (cross-attention is not fused)")
    tr = pv.outputs[0].outputs[0] if len(pv.outputs[0].outputs) == 1 else None
    if tr is None or tr.op != "Transpose" or list(tr.attrs.get("perm", [])) != [0, 2, 1, 3]:
        raise Decline("P V is not transposed back to [B, S, H, D]")
    rs = tr.outputs[0].outputs[0] if len(tr.outputs[0].outputs) == 1 else None
    if rs is None or rs.op != "Reshape":
        raise Decline("attention output is not reshaped to [B, S, E]")
    return Block(name_of(softmax), softmax, q, k, v, q_t, k_t, k_heads, mask, scale, rs)


def find_blocks(graph: gs.Graph, report: RuleReport) -> list[Block]:
    blocks = []
    for node in [n for n in graph.nodes if n.op == "Softmax"]:
        try:
            blocks.append(_match(node))
        except Decline as e:
            report.misses.append(f"attention at {name_of(node)}: {e}")
    return blocks


def probe_outputs(blocks: list[Block]) -> list[str]:
    """Tensor names whose values the probe run must return."""
    names = []
    for b in blocks:
        names.append(b.q_heads.name)
        if b.mask is not None:
            names.append(b.mask.name)
        if b.k_heads is not None:
            names += [b.k_heads.name, b.k_t.name]
    return sorted(set(names))


def classify_mask(m: np.ndarray, pad: np.ndarray | None, seq: int) -> str:
    """none | padding | causal | causal+padding, or raise Decline. pad: [B, S] 1 = keep."""
    finite_ok = np.all((m <= NEG_THRESHOLD) | (np.abs(m) < 1e-6))
    if not finite_ok:
        raise Decline("mask has values other than 0 and a large negative number (a bias, not a mask)")
    if m.ndim != 4:
        raise Decline(f"mask is {m.ndim}-D, expected a [B, 1, S, S] broadcast")
    visible = np.broadcast_to(m > NEG_THRESHOLD, (m.shape[0], m.shape[1], seq, seq))
    if not np.all(visible == visible[:, :1]):
        raise Decline("mask differs between heads")
    vis = visible[:, 0]
    batch = vis.shape[0]
    causal = np.broadcast_to(np.tril(np.ones((seq, seq), bool)), vis.shape)
    if vis.all():
        return "none"
    if np.array_equal(vis, causal):
        return "causal"
    if pad is not None and pad.shape[0] == batch:
        keep = np.broadcast_to(pad[:, None, :].astype(bool), vis.shape)
        if np.array_equal(vis, keep):
            return "padding"
        if np.array_equal(vis, keep & causal):
            return "causal+padding"
    raise Decline("mask is not a 2-D padding mask, a causal mask or both")


def validate(block: Block, values: dict[str, np.ndarray], pad: np.ndarray | None) -> None:
    q = values[block.q_heads.name]
    if q.ndim != 4:
        raise Decline("Q heads are not 4-D")
    block.heads, seq = int(q.shape[1]), int(q.shape[2])
    if block.heads * q.shape[3] != block.q.w.shape[1]:
        raise Decline("heads x head size differs from the projection width")
    if block.k_heads is not None and not np.allclose(
        values[block.k_t.name], np.swapaxes(values[block.k_heads.name], -1, -2), atol=1e-5
    ):
        raise Decline("the K path is not K^T")
    if block.mask is not None:
        block.mask_kind = classify_mask(values[block.mask.name], pad, seq)


def rewrite(graph: gs.Graph, block: Block, mask_index: gs.Tensor | None) -> None:
    w = np.concatenate([block.q.w, block.k.w, block.v.w], axis=1).astype(np.float32)
    b = np.concatenate([block.q.b, block.k.b, block.v.b]).astype(np.float32)
    inputs = [
        block.q.x,
        const_tensor(graph, f"{block.name}_qkv_weight", w),
        const_tensor(graph, f"{block.name}_qkv_bias", b),
    ]
    if "padding" in block.mask_kind:
        assert mask_index is not None
        inputs.append(mask_index)
    # The final Reshape stays, now fed by Attention's [B, S, E]: same element order as [B, S, H, D], and it
    # keeps whatever shape the next op wanted (GPT-2 flattens to [B*S, E] for its Gemm).
    out = variable(graph, f"{block.name}_attention_out")
    shape = block.out_reshape.inputs[1]
    block.out_reshape.inputs.clear()
    block.out_reshape.inputs.extend([out, shape])
    attrs = {"num_heads": block.heads, "scale": float(block.scale), "unidirectional": int("causal" in block.mask_kind)}
    graph.nodes.append(gs.Node("Attention", f"{block.name}_Attention", attrs, inputs, [out], domain=MS))


def mask_index_for(graph: gs.Graph, mask_input: gs.Tensor) -> gs.Tensor:
    """int32 copy of the 2-D attention mask, shared by every fused block."""
    out = variable(graph, f"{mask_input.name}_int32", np.int32)
    graph.nodes.append(gs.Node("Cast", f"{mask_input.name}_to_int32", {"to": 6}, [mask_input], [out]))
    return out
