"""Export for encoder-decoder generation (runtime/seq2seq.py): the prefill and decode graphs, checked against PyTorch.

Dims: prefill takes T5's input_ids/attention_mask [batch, seq] or Whisper's input_features [batch, n_mels, frames]
(frames fixed by the model) and returns logits, present.{i}.key/value [batch, heads, 1, head_dim] and
cross.{i}.key/value [batch, heads, enc, head_dim]; decode takes input_ids [batch, 1], T5's encoder_attention_mask
[batch, enc], past.{i}.* [batch, heads, past, head_dim] and cross.{i}.*, and returns logits and present.* one
longer. The check runs a short greedy generation in both and requires identical tokens and close logits.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.core.errors import PassError
from optimizer.core.pass_base import PassContext
from optimizer.core.quiet import quiet
from passes.graph_pair import graph_pair

SAMPLE_BATCH = 2  # exporters specialize a dim of size 1: the sample's batch, source length and past are above it
SAMPLE_SOURCE = 6  # T5's sample source tokens
SAMPLE_PAST = 3  # the decode sample's self-attention cache length


def _sample(prompt: np.ndarray, vocab: int, speech: bool) -> np.ndarray:
    """The prefill's sample prompt: the recipe's spectrogram shape (its frames are fixed), or random source ids."""
    if speech:
        rows = np.resize(prompt, (SAMPLE_BATCH, *prompt.shape[1:]))
        return np.ascontiguousarray(rows, np.float32)
    return np.random.default_rng(0).integers(0, vocab, (SAMPLE_BATCH, SAMPLE_SOURCE), dtype=np.int64)


def export_seq2seq(
    artifact: Artifact, ctx: PassContext, opset: int | None, min_cosine: float
) -> tuple[Artifact, dict[str, Any]]:
    import torch

    from optimizer.runtime.generation import cache_names
    from optimizer.runtime.models import load_module
    from optimizer.runtime.seq2seq import ENCODER_MASK, cross_names, encoder_arrays, prompt_of, seq2seq_wrappers

    model = load_module(ctx.recipe)
    prefill, decode, layout = seq2seq_wrappers(model)
    own, cross = cache_names(layout.layers), cross_names(layout.layers)
    speech = not layout.encoder_mask
    prompt = _sample(prompt_of(next(iter(ctx.feeds)).timing), int(model.config.vocab_size), speech)
    inputs = [torch.from_numpy(a) for a in encoder_arrays(layout.encoder_inputs, prompt)]
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
    enc, past = torch.export.Dim("enc"), torch.export.Dim("past", min=1)
    prefill_shapes = tuple({0: batch} if speech else {0: batch, 1: seq} for _ in inputs)
    decode_names = ["input_ids", *([] if speech else [ENCODER_MASK]), *(p for p, _ in own), *cross]
    log = io.StringIO()
    try:
        with quiet(log), torch.no_grad():
            torch.onnx.export(
                prefill,
                tuple(inputs),
                str(ctx.stage_dir / "prefill.tmp.onnx"),
                input_names=list(layout.encoder_inputs),
                output_names=["logits", *(p for _, p in own), *cross],
                dynamic_shapes=(prefill_shapes,),
                opset_version=opset,
                dynamo=True,
                external_data=False,
            )
            _, *caches = prefill(*inputs)
            # A self-attention cache longer than one position (prefill leaves one): a size-1 dim would be specialized.
            self_kv = [torch.randn(k.shape[0], k.shape[1], SAMPLE_PAST, k.shape[3]) for k in caches[: len(own)]]
            cross_kv = caches[len(own) :]
            rest = [*([] if speech else [inputs[1]]), *self_kv, *cross_kv]
            rest_shapes = [*([] if speech else [{0: batch, 1: enc}]), *({0: batch, 2: past} for _ in self_kv),
                           *({0: batch, 2: enc} for _ in cross_kv)]
            torch.onnx.export(
                decode,
                (torch.randint(0, int(model.config.vocab_size), (SAMPLE_BATCH, 1)), *rest),
                str(ctx.stage_dir / "decode.tmp.onnx"),
                input_names=decode_names,
                output_names=["logits", *(p for _, p in own)],
                dynamic_shapes=({0: batch}, tuple(rest_shapes)),
                opset_version=opset,
                dynamo=True,
                external_data=False,
            )
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PassError(f"encoder-decoder export failed: {first}") from e
    out = graph_pair(artifact, ctx, layout.layers)
    check = _check(model, out, ctx, min_cosine)
    notes = {"graphs": ["prefill.onnx", "decode.onnx"], "layers": layout.layers, "encoder_inputs":
             list(layout.encoder_inputs), "decoder_start_token_id": layout.start_token, "check": check,
             "log": log.getvalue()}
    return out, notes


def _check(model: Any, artifact: Artifact, ctx: PassContext, min_cosine: float) -> dict[str, Any]:
    from optimizer.runtime.runners.gen_runner import ort_generator
    from optimizer.runtime.seq2seq import TorchSeq2SeqGenerator, prompt_of

    torch_gen = TorchSeq2SeqGenerator(model, 1)
    ort_gen = ort_generator(artifact, ctx.recipe, device="cpu")
    prompt = prompt_of(next(iter(ctx.feeds)).timing)
    result: dict[str, Any] = ctx.check(torch_gen.generate(prompt, 8), ort_gen.generate(prompt, 8))
    if result["token_agreement"] < 1.0 or result["logits_cosine_min"] < min_cosine:
        raise PassError(f"the ONNX encoder-decoder loop disagrees with PyTorch: {result}")
    return result
