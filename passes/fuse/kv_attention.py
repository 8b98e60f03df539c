"""Attention over a KV cache -> com.microsoft.MultiHeadAttention, in a generation artifact's graphs.

A decoder layer's attention as torch.export writes it for a generation step, per layer i:
    K_new = Transpose(Reshape(k, [B, S, H, D]), [0, 2, 1, 3]); likewise V_new and Q
    present.i.key = Concat(past.i.key, K_new, axis=-2)       (prefill: present.i.key = K_new)
    out = softmax(scale Q K^T + M) present.i.value, transposed back and reshaped to [B, S, E]
where M is the additive causal + padding mask the graph builds from `attention_mask`, in some thirty shape,
range and comparison nodes per graph, and K^T is a Reshape/Transpose chain over the whole cache.
MultiHeadAttention(q, k, v, key_padding_mask, past_key, past_value) -> (out, present_key, present_value) with
`unidirectional` computes the same from the [B, S, E] projections: ONNX Runtime's CPU kernel appends the new
keys to the cache and runs the causal, padded attention in one node. On the small decode step of a generation
most of the time was those nodes and the copies of the cache between them (gpt2-cpu: TPOT 0.96 -> 0.80 ms).

Matching starts at each `present.{i}.key` / `present.{i}.value` output (optimizer.runtime.generation's cache
names) and walks to the P V MatMul, the Softmax and Q K^T, accepting the scale split over Q and K^T (SDPA) or
applied to the scores. The mask M is not classified by value here (the probe cannot make KV-cache inputs yet):
a layer is declined when M uses any graph input by value other than a 2-D `attention_mask` (which becomes the
key_padding_mask), or when there is no M at all (not causal). What M computes from those (causal + padding,
what a causal LM's cache graph builds) is then checked end to end: the pass runs the fused pair against its input
on the recipe's prompt and on a left-padded batch (passes/fuse/generation.py) before it keeps it, so a bias the
rewrite would drop (ALiBi, a sliding window shorter than the prompt) fails the stage. Cross-attention, grouped KV
heads, rotated keys and anything else that does not match are left as they are, with the reason per layer; so is
a layer one of whose intermediates is also read outside it (attention probabilities returned as an output, say).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from optimizer.runtime.generation import cache_names
from passes.fuse.attention import mask_index_for, split_scores
from passes.fuse.context import RuleContext
from passes.fuse.graph import MS, const, name_of, producer, variable
from passes.fuse.match import Decline, Match, Steps, between, fuse_each
from passes.fuse.rule import RuleReport

PRESENT = re.compile(r"present\.(\d+)\.key")


@dataclass
class CacheBlock:
    layer: int
    q: gs.Tensor  # [B, S, E] projections, before the split into heads
    k: gs.Tensor
    v: gs.Tensor
    past_key: gs.Tensor | None  # graph inputs in a decode graph; None in prefill
    past_value: gs.Tensor | None
    present_key: gs.Tensor
    present_value: gs.Tensor
    heads: int
    scale: float
    out_reshapes: list[gs.Node]  # the Reshapes of the attention output to [B, S, E] (or [B*S, E])


def _unheads(t: gs.Tensor) -> tuple[gs.Tensor, gs.Node]:
    """t = Transpose(Reshape(x, [B, S, H, D]), [0, 2, 1, 3]): returns x ([B, S, E]) and the Reshape."""
    tr = producer(t, "Transpose")
    if tr is None or list(tr.attrs.get("perm", [])) != [0, 2, 1, 3]:
        raise Decline(f"{t.name} is not Transpose(0,2,1,3) of the heads")
    rs = producer(tr.inputs[0], "Reshape")
    if rs is None:
        raise Decline(f"{t.name}: no Reshape to heads before its Transpose")
    return rs.inputs[0], rs


def _cache_side(present: gs.Tensor, past_name: str) -> tuple[gs.Tensor, gs.Tensor | None, gs.Node, gs.Node]:
    """(the new [B, S, E] projection, the past input or None, the node that made `present`, the head Reshape)."""
    node = producer(present)
    if node is not None and node.op == "Concat":
        axis = int(node.attrs.get("axis", 0))
        if axis not in (-2, 2) or len(node.inputs) != 2 or node.inputs[0].name != past_name:
            raise Decline(f"{present.name} is not Concat({past_name}, new, axis=-2)")
        x, rs = _unheads(node.inputs[1])
        return x, node.inputs[0], node, rs
    if node is None:
        raise Decline(f"{present.name} has no producer")
    x, rs = _unheads(present)
    return x, None, node, rs


def _value_inputs(t: gs.Tensor) -> set[str]:
    """The graph inputs t is computed from by value (a Shape node reads only its input's shape)."""
    seen: set[int] = set()
    found: set[str] = set()
    stack = [t]
    while stack:
        cur = stack.pop()
        if id(cur) in seen or isinstance(cur, gs.Constant):
            continue
        seen.add(id(cur))
        node = producer(cur)
        if node is None:
            if cur.name:
                found.add(cur.name)
        elif node.op != "Shape":
            stack.extend(node.inputs)
    return found


def _reaches(t: gs.Tensor, target: gs.Tensor, steps: int = 6) -> bool:
    """t is target through Reshape/Transpose only (K^T as torch.export writes it for SDPA)."""
    for _ in range(steps):
        if t is target:
            return True
        node = producer(t, ("Reshape", "Transpose"))
        if node is None:
            return False
        t = node.inputs[0]
    return t is target


def _heads(present: gs.Tensor, reshape: gs.Node) -> int:
    """H: the cache output's static dim 1, else the head Reshape's constant shape."""
    shape = present.shape or []
    if len(shape) == 4 and isinstance(shape[1], int) and shape[1] > 0:
        return int(shape[1])
    target = const(reshape.inputs[1])
    if target is not None and target.size == 4 and int(target[2]) > 0:
        return int(target[2])
    raise Decline(f"{present.name}: number of heads unknown (no static dim 1, no constant head Reshape)")


def match_layer(graph: gs.Graph, layer: int, padded: bool) -> tuple[CacheBlock, list[gs.Node]]:
    """The layer's attention, and the nodes that made its cache outputs (removed by the rewrite). `padded`: the
    graph has a 2-D attention_mask input to pass on as the key_padding_mask."""
    tensors = graph.tensors()
    (past_key, present_key), (past_value, present_value) = cache_names(layer + 1)[2 * layer :]
    pk, pv = tensors[present_key], tensors[present_value]
    k, past_k, k_node, k_reshape = _cache_side(pk, past_key)
    v, past_v, v_node, v_reshape = _cache_side(pv, past_value)
    if (past_k is None) != (past_v is None):
        raise Decline("key and value caches differ (one has a past input, the other not)")
    pv_mm = [n for n in pv.outputs if n.op == "MatMul" and n.inputs[1] is pv]
    if len(pv_mm) != 1:
        raise Decline(f"{pv.name} does not go into exactly one P V MatMul")
    probs = pv_mm[0].inputs[0]
    guard = producer(probs, "Where")  # SDPA's NaN guard: Where(IsNaN(p), 0, p)
    if guard is not None and producer(guard.inputs[0], "IsNaN") is not None:
        probs = guard.inputs[2]
    softmax = producer(probs, "Softmax")
    if softmax is None:
        raise Decline("P is not a Softmax")
    q_heads, k_t, mask, scale = split_scores(softmax)  # what mask computes is checked end to end
    if mask is None:
        raise Decline("no additive mask on the scores: not causal attention")
    by_value = _value_inputs(mask)
    if by_value - {"attention_mask"}:
        others = ", ".join(sorted(by_value - {"attention_mask"}))
        raise Decline(f"the mask reads {others} by value (not only a 2-D attention_mask)")
    if "attention_mask" in by_value and not padded:
        raise Decline("the mask reads attention_mask, which is not a 2-D input")
    if not _reaches(k_t, pk):
        raise Decline(f"K^T is not a Reshape/Transpose chain over {pk.name}")
    q, q_reshape = _unheads(q_heads)
    if not (q_reshape.inputs[1] is k_reshape.inputs[1] is v_reshape.inputs[1]) and not _same_const(
        q_reshape, k_reshape, v_reshape
    ):
        raise Decline("Q, K and V are split into heads by different shapes (grouped KV heads?)")
    out = pv_mm[0].outputs[0]
    back = out.outputs[0] if len(out.outputs) == 1 else None
    if back is not None and back.op == "Reshape":  # [B, H, S, D] kept as is by a no-op Reshape first
        out = back.outputs[0]
        back = out.outputs[0] if len(out.outputs) == 1 else None
    if back is None or back.op != "Transpose" or list(back.attrs.get("perm", [])) != [0, 2, 1, 3]:
        raise Decline("P V is not transposed back to [B, S, H, D]")
    users = [u for u in back.outputs[0].outputs if u.op == "Reshape"]  # other readers: the escape check's
    if not users:
        raise Decline("attention output is not reshaped to [B, S, E]")
    block = CacheBlock(
        layer, q, k, v, past_k, past_v, pk, pv, _heads(pk, q_reshape), scale, users
    )
    return block, [k_node, v_node]


def _same_const(*reshapes: gs.Node) -> bool:
    shapes = [const(r.inputs[1]) for r in reshapes]
    return all(s is not None for s in shapes) and all(np.array_equal(shapes[0], s) for s in shapes[1:])


def rewrite(graph: gs.Graph, block: CacheBlock, producers: list[gs.Node], mask: gs.Tensor | None) -> None:
    out = variable(graph, f"mha_{block.layer}_out", block.q.dtype or np.float32)
    for rs in block.out_reshapes:  # [B, S, E] in the same element order as [B, S, H, D]
        shape = rs.inputs[1]
        rs.inputs.clear()
        rs.inputs.extend([out, shape])
    for node in producers:  # the cache outputs now come from MultiHeadAttention
        node.outputs.clear()
    empty = gs.Variable.empty()
    inputs = [block.q, block.k, block.v, empty, mask if mask is not None else empty, empty]
    if block.past_key is not None:
        inputs += [block.past_key, block.past_value]
    attrs = {"num_heads": block.heads, "scale": float(block.scale), "unidirectional": 1}
    node = gs.Node(
        "MultiHeadAttention",
        f"MultiHeadAttention_{block.layer}",
        attrs,
        inputs,
        [out, block.present_key, block.present_value],
        domain=MS,
    )
    graph.nodes.append(node)


@dataclass
class KvMatch(Match):
    block: CacheBlock
    producers: list[gs.Node]


def match_kv(graph: gs.Graph, layer: int, padded: bool) -> KvMatch:
    """The layer's attention (`match_layer`) with the nodes it is made of: those computing the cache outputs and
    the [B, S, E] Reshapes of the attention output from Q, K, V and the past cache; the Reshapes stay (rewired)."""
    try:
        block, producers = match_layer(graph, layer, padded)
    except KeyError as e:  # a probe value the walk needed is missing
        raise Decline(str(e)) from e
    inputs = [block.q, block.k, block.v, *(t for t in (block.past_key, block.past_value) if t is not None)]
    outputs = [block.present_key, block.present_value, *(rs.outputs[0] for rs in block.out_reshapes)]
    return KvMatch(between(inputs, outputs), outputs, block, producers)


def fuse_kv_attention(graph: gs.Graph, ctx: RuleContext) -> RuleReport:
    report = RuleReport()
    if any(t.name.startswith("cross.") for t in [*graph.inputs, *graph.outputs]):  # runtime.seq2seq's names
        report.skipped = ("an encoder-decoder's graph (cross-attention K/V): this rule knows a decoder's attention "
                          "only (its masks read the decoder's own attention_mask; T5 adds a position bias)")
        return report
    layers = sorted(int(m.group(1)) for t in graph.outputs if (m := PRESENT.fullmatch(t.name)))
    if not layers:
        report.misses.append("no present.{i}.key outputs: no KV cache named as export writes it")
    attention_mask = next((t for t in graph.inputs if t.name == "attention_mask" and len(t.shape or []) == 2), None)
    masks: list[gs.Tensor] = []  # its int32 copy, MultiHeadAttention's key_padding_mask over past + new keys

    def fuse(graph: gs.Graph, ctx: RuleContext, m: KvMatch) -> str:
        if not masks and attention_mask is not None:
            masks.append(mask_index_for(graph, attention_mask))
        mask = masks[0] if masks else None
        rewrite(graph, m.block, m.producers, mask)
        cache = "past + new keys" if m.block.past_key is not None else "new keys (prefill)"
        return (
            f"layer {m.block.layer}: {m.block.heads} heads, scale {m.block.scale:.4g}, cache {cache}, "
            f"causal{' + padding' if mask is not None else ''} (replaced {name_of(m.producers[0])})"
        )

    steps: Steps[int, KvMatch] = Steps(
        "kv attention",
        lambda graph, ctx, layer: match_kv(graph, layer, attention_mask is not None),
        fuse,
        place=lambda layer: f"kv attention of layer {layer}",
    )
    return fuse_each(graph, ctx, layers, steps, report)
