"""Export for generation: the prefill and decode graphs (see optimizer/runtime/generation.py), checked against PyTorch.
An encoder-decoder's pair (model.task text2text-generation / automatic-speech-recognition) is passes/export_seq2seq.py.

Dims: prefill takes input_ids/attention_mask [batch, seq]; decode takes input_ids [batch, 1], attention_mask
[batch, past + 1] and past.{i}.key/value [batch, heads, past, head_dim], and returns present.* one longer.
The check runs a short greedy generation in both and requires identical tokens and close logits.
"""

from __future__ import annotations

import io
from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.pass_base import PassContext
from optimizer.core.quiet import quiet
from optimizer.recipe.schema import SEQ2SEQ_TASKS
from passes.graph_pair import graph_pair


def export_generation(
    artifact: Artifact, ctx: PassContext, opset: int | None, min_cosine: float
) -> tuple[Artifact, dict[str, Any]]:
    if getattr(ctx.recipe.model, "task", None) in SEQ2SEQ_TASKS:  # an encoder-decoder: its own pair of graphs
        from passes.export_seq2seq import export_seq2seq

        return export_seq2seq(artifact, ctx, opset, min_cosine)
    import torch

    from optimizer.runtime.generation import cache_names, wrappers
    from optimizer.runtime.models import load_module

    model = load_module(ctx.recipe)
    prefill, decode, layers = wrappers(model)
    names = cache_names(layers)
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, vocab, (2, 6))
    mask = torch.ones_like(ids)
    batch, seq, past = torch.export.Dim("batch"), torch.export.Dim("seq"), torch.export.Dim("past", min=1)
    log = io.StringIO()
    try:
        with quiet(log), torch.no_grad():
            torch.onnx.export(
                prefill,
                (ids, mask),
                str(ctx.stage_dir / "prefill.tmp.onnx"),
                input_names=["input_ids", "attention_mask"],
                output_names=["logits"] + [p for _, p in names],
                dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}),
                opset_version=opset,
                dynamo=True,
                external_data=False,
            )
            _, *cache = prefill(ids, mask)
            step_ids = torch.randint(0, vocab, (2, 1))
            step_mask = torch.ones((2, ids.shape[1] + 1), dtype=torch.long)
            cache_shapes = tuple({0: batch, 2: past} for _ in cache)
            torch.onnx.export(
                decode,
                (step_ids, step_mask, *cache),
                str(ctx.stage_dir / "decode.tmp.onnx"),
                input_names=["input_ids", "attention_mask"] + [p for p, _ in names],
                output_names=["logits"] + [p for _, p in names],
                dynamic_shapes=({0: batch}, {0: batch, 1: past + 1}, cache_shapes),
                opset_version=opset,
                dynamo=True,
                external_data=False,
            )
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PassError(f"generation export failed: {first}") from e
    out = graph_pair(artifact, ctx, layers)
    check = _check(model, out, ctx, min_cosine)
    return out, {"graphs": ["prefill.onnx", "decode.onnx"], "layers": layers, "check": check, "log": log.getvalue()}


def _check(model: Any, artifact: Artifact, ctx: PassContext, min_cosine: float) -> dict[str, Any]:
    from optimizer.runtime.generation import TorchGenerator
    from optimizer.runtime.runners.gen_runner import ort_generator

    torch_gen = TorchGenerator(model, 1)
    ort_gen = ort_generator(artifact, ctx.recipe, device="cpu")
    prompt = next(iter(ctx.feeds)).timing["input_ids"]
    result: dict[str, Any] = ctx.check(torch_gen.generate(prompt, 8), ort_gen.generate(prompt, 8))
    if result["token_agreement"] < 1.0 or result["logits_cosine_min"] < min_cosine:
        raise PassError(f"the ONNX generation loop disagrees with PyTorch: {result}")
    return result
