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
  * separate Q/K/V MatMuls, or one packed MatMul split three ways (GPT-2's Conv1D);
  * the TorchScript exporter's forms (and Optimum's, which uses it): Shape nodes reading P V and the heads (the
    next Reshape's target is computed from them), SDPA's Reshape of P V back to [B, H, S, D] before the Transpose
    (any short Reshape/Transpose chain there is checked on the probe to merge the heads exactly), a Cast to float
    after Softmax, and the one-input Concat a KV cache that starts empty leaves on K and V.
The output Reshape gets a constant target where the probe shows one reads the same (it is dropped where it gives
Attention's [B, S, E] unchanged), so the per-block shape arithmetic TorchScript writes for it goes too. A block is
fused only if rewriting it removes it: where a tensor inside it is used elsewhere, it is declined.
The additive mask M is classified by evaluating the graph on a probe input (batch 2, the second row padded):
none, padding (from a 2-D attention_mask input), causal, or causal + padding. Anything else (ALiBi, relative
position bias, a 3-D mask) is left unfused, and the reason is reported per block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from passes.fuse.graph import MS, const, const_tensor, name_of, producer, scalar, variable
from passes.fuse.match import Decline  # the one decline type of every rule
from passes.fuse.rule import RuleReport

FLOAT = 1  # onnx.TensorProto.FLOAT
NEG_THRESHOLD = -1e4  # additive mask entries at or below this count as "masked"


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
    pv: gs.Tensor  # P V, [B, H, S, D]
    merged: gs.Tensor | None  # out_reshape's output, when the probe must show it is P V with the heads merged
    heads: int = 0
    mask_kind: str = "none"
    # Whether the graph computes the output Reshape's target from a tensor inside the block (TorchScript writes
    # Shape(P V transposed)), and the constant target that reads the same on Attention's [B, S, E] (`validate`).
    own_shape: bool = False
    core: list[gs.Node] = field(default_factory=list)  # Q K^T, Softmax, P V: what fusing must remove
    out_shape: list[int] | None = None


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


def _through(t: gs.Tensor) -> gs.Tensor:
    """t with identities peeled off: Identity, and the one-input Concat the TorchScript exporter writes for a KV
    cache that starts empty (GPT-2's torch.cat of the new key onto no past)."""
    while True:
        node = producer(t, ("Identity", "Concat"))
        if node is None or len(node.inputs) != 1:
            return t
        t = node.inputs[0]


def _heads(t: gs.Tensor, perm: list[int]) -> Projection:
    """t = Transpose(Reshape(linear), perm): the per-head view of a projection."""
    tr = producer(_through(t), "Transpose")
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
        node = producer(_through(cur), ("Reshape", "Transpose"))
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
    for _ in range(3):
        users = list(probs.outputs)
        guard = next((u for u in users if u.op == "Where"), None)
        if guard is not None and {u.op for u in users} <= {"IsNaN", "Where"}:
            probs = guard.outputs[0]
        elif len(users) == 1 and users[0].op == "Cast" and users[0].attrs.get("to") == FLOAT:
            probs = users[0].outputs[0]  # softmax(..., dtype=float32).to(dtype) on a float32 graph: TorchScript's form
        else:
            break
    pv = next((u for u in probs.outputs if u.op == "MatMul" and u.inputs[0] is probs), None)
    if pv is None or len(probs.outputs) != 1:
        raise Decline("softmax output does not go (only) into P V")
    v = _heads(pv.inputs[1], [0, 2, 1, 3])
    if not (q.x is k.x is v.x):
        raise Decline("Q, K and V are not projections of one input (cross-attention is not fused)")
    out_reshape, merged = _output_side(pv.outputs[0])
    block = Block(name_of(softmax), softmax, q, k, v, q_t, k_t, k_heads, mask, scale, out_reshape, pv.outputs[0],
                  merged)
    block.core = [_scores_matmul(softmax), softmax, pv]
    return block


def _scores_matmul(softmax: gs.Node) -> gs.Node:
    """The Q K^T MatMul under softmax's input, as `split_scores` found it (scale and mask Add peeled off)."""
    add = producer(softmax.inputs[0], "Add")
    for t in add.inputs if add is not None else softmax.inputs[:1]:
        mm = producer(_strip_scale(t)[0], "MatMul")
        if mm is not None:
            return mm
    raise Decline("softmax input is not Q K^T")


def _data_user(t: gs.Tensor) -> gs.Node | None:
    """The one node that reads t's values, else None. Shape nodes read only its shape and are not counted: the
    TorchScript exporter computes the next Reshape's target from them (whether they are used anywhere else is
    checked for the whole block, see `_stays_alive`)."""
    users = [u for u in t.outputs if u.op != "Shape"]
    return users[0] if len(users) == 1 and users[0].inputs[0] is t else None


def _output_side(pv_out: gs.Tensor) -> tuple[gs.Node, gs.Tensor | None]:
    """From P V [B, H, S, D] to the Reshape whose output is the attention output in [B, S, E] order.

    Returns (that Reshape, None) for the usual Transpose(0,2,1,3) + Reshape, and (that Reshape, its output) for any
    other short Reshape/Transpose chain, whose output the probe must show to be P V with its heads merged
    (TorchScript's SDPA writes Reshape(P V) back to [B, H, S, D] first)."""
    tr = _data_user(pv_out)
    if tr is not None and tr.op == "Transpose" and list(tr.attrs.get("perm", [])) == [0, 2, 1, 3]:
        rs = _data_user(tr.outputs[0])
        if rs is None or rs.op != "Reshape":
            raise Decline("attention output is not reshaped to [B, S, E]")
        return rs, None
    # Up to the first Reshape after a Transpose: where the heads are merged, if anywhere.
    cur, transposed = pv_out, False
    for _ in range(4):
        node = _data_user(cur)
        if node is None or node.op not in ("Reshape", "Transpose"):
            break
        if node.op == "Reshape" and transposed:
            return node, node.outputs[0]
        transposed |= node.op == "Transpose"
        cur = node.outputs[0]
    raise Decline("P V is not transposed back to [B, S, H, D]")


def _inside(block: Block) -> set[int]:
    """Ids of the block's nodes from Q K^T to P V's merge: those downstream of its core and upstream of the output
    Reshape's data input (the core included)."""
    down: set[int] = set()
    stack = list(block.core)
    while stack:
        node = stack.pop()
        if id(node) in down or node is block.out_reshape:
            continue
        down.add(id(node))
        stack.extend(c for t in node.outputs for c in t.outputs)
    up: set[int] = set()
    tensors = [block.out_reshape.inputs[0]]
    while tensors:
        node = producer(tensors.pop())
        if node is None or id(node) in up or id(node) not in down:
            continue
        up.add(id(node))
        tensors.extend(node.inputs)
    return up | {id(c) for c in block.core}


def _stays_alive(graph: gs.Graph, block: Block, with_shape: bool = True) -> str | None:
    """Why the unfused block would still be computed once its output Reshape reads Attention's output (and, if
    not with_shape, a constant target shape), or None: the tensor inside it (a Shape of one, typically) that a
    graph output or a node outside it still reads, as "intermediate T is also a graph output / used by N"."""
    inside = _inside(block)
    seen: set[int] = set()
    stack: list[tuple[Any, str | None]] = [(t, None) for t in graph.outputs]
    while stack:
        t, reader = stack.pop()
        node = producer(t)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) in inside:
            return f"intermediate {t.name} is also " + ("a graph output" if reader is None else f"used by {reader}")
        if node is block.out_reshape:
            stack.extend((i, name_of(node)) for i in (node.inputs[1:] if with_shape else []))
        else:
            stack.extend((i, name_of(node)) for i in node.inputs)
    return None


def find_blocks(graph: gs.Graph, report: RuleReport) -> list[Block]:
    blocks = []
    for node in [n for n in graph.nodes if n.op == "Softmax"]:
        try:
            block = _match(node)
            if _stays_alive(graph, block):
                if (why := _stays_alive(graph, block, with_shape=False)) is not None:
                    raise Decline(why)
                block.own_shape = True
            blocks.append(block)
        except Decline as e:
            report.misses.append(f"attention at {name_of(node)}: {e}")
    return blocks


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
    if block.merged is not None:
        pv, merged = values[block.pv.name], values[block.merged.name]
        want = np.swapaxes(pv, 1, 2)  # [B, S, H, D]: the order Attention writes its [B, S, E] output in
        if merged.size != want.size or not np.array_equal(merged.reshape(-1), want.reshape(-1)):
            raise Decline(
                "the Reshape/Transpose chain after P V does not merge the heads to [B, S, E] (a Reshape in it is "
                "not the identity on the probe)"
            )
    # A constant target for the output Reshape where one reads the same: the graph's own target is often computed
    # per block from the input's shape (Shape, Gather, Unsqueeze, Concat: TorchScript's form), and must be when it
    # is computed from a tensor inside the block.
    out = values.get(block.out_reshape.outputs[0].name)
    try:
        block.out_shape = _target_shape(block, out.shape, q.shape) if out is not None else None
    except Decline:
        if block.own_shape:
            raise
    if block.own_shape and block.out_shape is None:
        raise Decline("the output Reshape's shape is computed inside the block and has no probe value")
    if block.mask is not None:
        block.mask_kind = classify_mask(values[block.mask.name], pad, seq)


def _target_shape(block: Block, out: tuple[int, ...], q: tuple[int, ...]) -> list[int]:
    """A constant target for the output Reshape that gives, from Attention's [B, S, E], the shape the probe shows
    it giving now: [0, 0, E] when that is [B, S, E] itself (the Reshape is then dropped, so its allowzero does not
    matter), or [-1, E] for [B*S, E] (GPT-2 flattens for its Gemm)."""
    batch, seq, width = q[0], q[2], q[1] * q[3]
    if tuple(out) == (batch, seq, width):
        return [0, 0, width]
    if tuple(out) == (batch * seq, width):
        return [-1, width]
    raise Decline(f"the output Reshape's shape is computed inside the block and its result {tuple(out)} is neither "
                  "[B, S, E] nor [B*S, E]")


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
    attrs = {"num_heads": block.heads, "scale": float(block.scale), "unidirectional": int("causal" in block.mask_kind)}
    if block.out_shape is not None and block.out_shape[:2] == [0, 0]:  # the Reshape would give [B, S, E] as it is
        out = block.out_reshape.outputs[0]
        block.out_reshape.outputs.clear()
        graph.nodes.append(gs.Node("Attention", f"{block.name}_Attention", attrs, inputs, [out], domain=MS))
        return
    # Otherwise the final Reshape stays, now fed by Attention's [B, S, E]: same element order as [B, S, H, D], and
    # it keeps whatever shape the next op wanted (GPT-2 flattens to [B*S, E] for its Gemm).
    out = variable(graph, f"{block.name}_attention_out")
    shape = block.out_reshape.inputs[1]
    if block.out_shape is not None:
        shape = const_tensor(graph, f"{block.name}_out_shape", np.array(block.out_shape, np.int64))
    block.out_reshape.inputs.clear()
    block.out_reshape.inputs.extend([out, shape])
    graph.nodes.append(gs.Node("Attention", f"{block.name}_Attention", attrs, inputs, [out], domain=MS))


def mask_index_for(graph: gs.Graph, mask_input: gs.Tensor) -> gs.Tensor:
    """int32 copy of the 2-D attention mask, shared by every fused block."""
    out = variable(graph, f"{mask_input.name}_int32", np.int32)
    graph.nodes.append(gs.Node("Cast", f"{mask_input.name}_to_int32", {"to": 6}, [mask_input], [out]))
    return out
