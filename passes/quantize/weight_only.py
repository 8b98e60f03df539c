"""Weight-only quantization (`quantize` with `mode: weight_only`): ONNX Runtime's MatMulNBits.

A decoder generating at batch 1 reads every weight once per token and does little arithmetic with it, so a
decode step is bound by memory traffic, not by compute. Storing the weights of every MatMul in 4 or 8 bits
(blocks of `block_size` weights along K, one scale each, plus a zero point when asymmetric) cuts what each
token reads; the activations stay in float. ONNX Runtime's MatMulNBits kernel (com.microsoft) runs it, and
onnxruntime.quantization.matmul_nbits_quantizer writes it (round to nearest; no calibration data).

That quantizer rewrites only MatMul nodes whose second input is a 2-D initializer. Exported graphs hold their
weights in two other forms, which are rewritten into that one first:
- Gemm (GPT-2's Conv1D is `addmm`, exported as Gemm): MatMul with the weight (transposed if transB, times
  alpha) and an Add of the bias (times beta);
- MatMul of a Transpose of an initializer (a tied LM head: the embedding table, transposed): the transposed
  table as an initializer of its own, which the quantizer can pack (the Gather of the embedding keeps the
  float table).
MatMuls of two activations (attention scores, attention times values) have no weight and stay float.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.names import unique_name
from optimizer.core.pass_base import PassConfig, PassContext

QUANTIZER_LOGGER = "onnxruntime.quantization.matmul_nbits_quantizer"


class WeightOnlySettings(PassConfig):
    bits: Literal[4, 8] = Field(default=4, description="bits per weight (MatMulNBits)")
    block_size: int = Field(
        default=32, description="weights per scale along the reduction dim K: a power of two, at least 16"
    )
    symmetric: bool = Field(
        default=False, description="signed weights around zero (no zero points); asymmetric keeps a block's range"
    )
    accuracy_level: Literal[0, 1, 2, 3, 4] | None = Field(
        default=None,
        description="MatMulNBits' compute type on the CPU: 1 fp32, 2 fp16, 3 bf16, 4 int8 activations (ONNX "
        "Runtime's integer kernels; fastest where it has them, least accurate); none: ONNX Runtime's default",
    )

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        # MatMulNBits takes only these block sizes; any other is refused by ONNX Runtime at load time.
        if v < 16 or v & (v - 1):
            raise ValueError(f"block_size must be a power of two >= 16, got {v}")
        return v


def quantize(src: Path, dst: Path, settings: WeightOnlySettings, exclude: list[str]) -> dict[str, object]:
    """Write src with every constant-weight MatMul (and Gemm) as MatMulNBits into dst; the notes say which
    nodes were packed, which stayed float and why, and the weight bytes before and after."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from optimizer.runtime import onnx_io

    model = onnx_io.load(src)
    before = onnx_io.weight_bytes(model)
    rewrites, kept = prepare(model)
    with _quiet_quantizer():
        quantizer = MatMulNBitsQuantizer(
            model,
            bits=settings.bits,
            block_size=settings.block_size,
            is_symmetric=settings.symmetric,
            accuracy_level=settings.accuracy_level,
            nodes_to_exclude=exclude,
            op_types_to_quantize=("MatMul",),
        )
        quantizer.process()
    out = quantizer.model.model
    packed = packed_nodes(out, settings.bits)
    if not packed:
        why = "; ".join(sorted(set(kept.values()))) or "the graph has none"
        raise PassError(
            "weight_only quantized nothing: no MatMul or Gemm with a constant 2-D weight outside exclude_nodes "
            f"({len(kept)} kept float: {why})"
        )
    for name in exclude:
        kept.setdefault(name, "in exclude_nodes")
    for node in out.graph.node:  # weights the quantizer declined (N-D with batch dims, say)
        if node.op_type == "MatMul" and node.name not in kept:
            kept[node.name] = "not packed by the quantizer (weight not 2-D)"
    after = onnx_io.weight_bytes(out)
    onnx_io.save(out, dst)
    return {
        "bits": settings.bits,
        "block_size": settings.block_size,
        "symmetric": settings.symmetric,
        "accuracy_level": settings.accuracy_level,
        "matmul_nbits": packed,
        "kept_float": kept,
        "rewritten": rewrites,
        "weight_bytes": {"before": before, "after": after, "ratio": round(after / before, 4) if before else None},
    }


def prepare(model: Any) -> tuple[dict[str, int], dict[str, str]]:
    """Rewrite Gemm and MatMul(Transpose(initializer)) into MatMul with an initializer weight, in place.
    Returns (how many of each rewrite, {MatMul or Gemm left float: why})."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    names = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    producer = {o: n for n in graph.node for o in n.output}
    rewrites = {"gemm_to_matmul": 0, "transpose_folded": 0}
    folded: dict[str, str] = {}  # transposed source -> its folded copy, shared by every MatMul reading it
    kept: dict[str, str] = {}
    nodes: list[Any] = []
    for node in graph.node:
        if node.op_type == "Gemm":
            replaced = _gemm_as_matmul(node, inits, names, graph)
            if isinstance(replaced, str):
                kept[node.name] = replaced
                nodes.append(node)
            else:
                rewrites["gemm_to_matmul"] += 1
                nodes.extend(replaced)
            continue
        if node.op_type == "MatMul" and node.input[1] not in inits:
            weight = _fold_transpose(node.input[1], producer, inits, names, folded, graph)
            if weight is None:
                kept[node.name] = "no constant weight (both inputs are activations)"
            else:
                node.input[1] = weight
                rewrites["transpose_folded"] += 1
        nodes.append(node)
    graph.ClearField("node")
    graph.node.extend(_drop_unused_transposes(nodes, graph))
    return rewrites, kept


def _attr(node: Any, name: str, default: float) -> float:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return float(helper.get_attribute_value(a))
    return default


def _gemm_as_matmul(node: Any, inits: dict[str, Any], names: set[str], graph: Any) -> list[Any] | str:
    """Gemm(A, B, C) = alpha * A @ op(B) + beta * C as MatMul(A, W) [+ Add(C')], W = alpha * op(B) a new
    initializer when it differs from B (B may feed other nodes); or why not."""
    from onnx import helper, numpy_helper

    alpha, beta = _attr(node, "alpha", 1.0), _attr(node, "beta", 1.0)
    if _attr(node, "transA", 0):
        return "Gemm with transA"
    weight = inits.get(node.input[1])
    if weight is None or len(weight.dims) != 2:
        return "no constant 2-D weight"
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    if bias is not None and beta != 1.0 and bias not in inits:
        return "Gemm with beta != 1 on a computed bias"
    w_name = node.input[1]
    if _attr(node, "transB", 0) or alpha != 1.0:
        w = numpy_helper.to_array(weight)
        w = (w.T if _attr(node, "transB", 0) else w) * np.asarray(alpha, dtype=w.dtype)
        w_name = unique_name(f"{node.input[1]}_kn", names)
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(w), w_name))
        inits[w_name] = graph.initializer[-1]
    if bias is not None and beta != 1.0:
        c = numpy_helper.to_array(inits[bias])
        bias = unique_name(f"{bias}_beta", names)
        graph.initializer.append(numpy_helper.from_array(c * np.asarray(beta, dtype=c.dtype), bias))
        inits[bias] = graph.initializer[-1]
    out = node.output[0]
    if bias is None:  # the MatMul keeps the Gemm's name, so exclude_nodes and the notes name it as before
        return [helper.make_node("MatMul", [node.input[0], w_name], [out], name=node.name)]
    mid = unique_name(f"{out}_matmul", names)
    return [
        helper.make_node("MatMul", [node.input[0], w_name], [mid], name=node.name),
        helper.make_node("Add", [mid, bias], [out], name=unique_name(f"{node.name}_bias", names)),
    ]


def _fold_transpose(
    tensor: str, producer: dict[str, Any], inits: dict[str, Any], names: set[str], folded: dict[str, str], graph: Any
) -> str | None:
    """The name of an initializer holding Transpose(initializer) when `tensor` is that (2-D), else None."""
    from onnx import numpy_helper

    node = producer.get(tensor)
    if node is None or node.op_type != "Transpose" or node.input[0] not in inits:
        return None
    source = inits[node.input[0]]
    perm = [a.ints for a in node.attribute if a.name == "perm"]
    if len(source.dims) != 2 or (perm and list(perm[0]) != [1, 0]):
        return None
    if node.input[0] not in folded:
        name = unique_name(f"{node.input[0]}_T", names)
        graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(source).T), name))
        inits[name] = graph.initializer[-1]
        folded[node.input[0]] = name
    return folded[node.input[0]]


def _drop_unused_transposes(nodes: list[Any], graph: Any) -> list[Any]:
    """Transposes whose output nothing reads any more (folded above): left in, they would still run per call."""
    used = {i for n in nodes for i in n.input} | {o.name for o in graph.output} | _read_in_subgraphs(nodes)
    return [n for n in nodes if n.op_type != "Transpose" or any(o in used for o in n.output)]


def _read_in_subgraphs(nodes: list[Any]) -> set[str]:
    """Names the bodies of If/Loop/Scan nodes read (they may read the outer graph's tensors)."""
    read: set[str] = set()
    for node in nodes:
        for a in node.attribute:
            for g in [a.g, *a.graphs] if a.HasField("g") else list(a.graphs):
                read |= {i for n in g.node for i in n.input} | _read_in_subgraphs(list(g.node))
    return read


def packed_nodes(model: Any, bits: int) -> list[dict[str, object]]:
    """Every MatMulNBits: the MatMul it replaced (the quantizer names it `<name>_Q<bits>`), K and N."""
    from onnx import helper

    suffix = f"_Q{bits}"
    out = []
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            name = node.name[: -len(suffix)] if node.name.endswith(suffix) else node.name
            out.append({"node": name, "K": int(attrs["K"]), "N": int(attrs["N"])})
    return out


@contextmanager
def _quiet_quantizer() -> Iterator[None]:
    """The quantizer logs every node at INFO through a handler of its own (not silenced by core.quiet)."""
    logger = logging.getLogger(QUANTIZER_LOGGER)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_against_input(before: Artifact, after: Artifact, ctx: PassContext) -> dict[str, object]:
    """How far the packed weights moved the model from its float input (recorded, not gated: the budget is the
    pipeline's, against stage 0). Generation: greedy token agreement and logits cosine on the first scenario's
    prompt for its new_tokens; forward: the worst cosine per output over the recipe's samples."""
    if before.decode:
        from optimizer.runtime.runners.gen_runner import ort_generator

        first = next(iter(ctx.feeds))
        prompt, new = first.timing["input_ids"], first.scenario.new_tokens
        reference = ort_generator(before, ctx.recipe, device="cpu").generate(prompt, new)
        candidate = ort_generator(after, ctx.recipe, device="cpu").generate(prompt, new)
        agreement: dict[str, object] = ctx.check(reference, candidate)
        return {"against": "the input graphs (float weights)", "scenario": first.scenario.name, **agreement}
    check = ctx.check(before, after)
    return {
        "against": "the input graph (float weights)",
        "cosine": {name: a.cosine for name, a in check.per_output.items()},
    }
