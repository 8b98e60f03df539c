"""Encoder-decoder generation (T5, Whisper): the encoder once, then the decoder token by token, greedily.

Two graphs serve one loop, as for a causal LM (runtime/generation.py):
- prefill = the encoder and the decoder's first step from `decoder_start_token_id`, in one call: the encoder's
  inputs (T5: input_ids + attention_mask; Whisper: input_features [batch, n_mels, frames]) -> the first logits,
  the decoder's self-attention cache (one position) and the cross-attention keys and values of every layer;
- decode = one decoder step: the token, the self-attention cache, the cross-attention K/V (and T5's encoder
  attention mask) -> logits and the self-attention cache one position longer.
The cross-attention K/V are computed once, by prefill, and fed unchanged to every step: they are the loop's fixed
inputs (named `cross.{i}.key|value`), never echoed back as outputs to be copied each step.

The "prompt" a generation starts from is the encoder's main input (T5's token ids, Whisper's mel spectrogram);
T5's encoder attention mask is all ones, as a causal LM's prompt mask is. Decoding is greedy for exactly
`new_tokens` steps, as for decoders, so stage 0 and every exported stage time the same work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from optimizer.core.errors import OptimizerError
from optimizer.runtime.generation import Generation, cache_keyword, cache_names, greedy_loop, torch_snapshot

TEXT_INPUTS = ("input_ids", "attention_mask")  # a text encoder's (T5's) prefill inputs
SPEECH_INPUTS = ("input_features",)  # a speech encoder's (Whisper's): the log-mel spectrogram
ENCODER_MASK = "encoder_attention_mask"  # the decode step's copy of the text encoder's mask
DESCRIPTION = {  # what the report's runtime says of an encoder-decoder's loop
    "model": "encoder-decoder",
    "prefill": "encoder + the decoder's first step from decoder_start_token_id",
    "cross_attention_cache": "computed once by prefill, a fixed input of every decode step",
}


def cross_names(layers: int) -> list[str]:
    """The cross-attention key and value of every decoder layer, in order: prefill outputs them, decode takes them."""
    return [f"cross.{i}.{k}" for i in range(layers) for k in ("key", "value")]


def prompt_of(feed: Mapping[str, np.ndarray]) -> np.ndarray:
    """The array a generation starts from in one sample's feed: input_ids (a causal LM's prompt, a text
    encoder-decoder's source text), else input_features (a speech encoder's spectrogram). Raises OptimizerError
    naming the feed's inputs when it has neither."""
    for name in ("input_ids", *SPEECH_INPUTS):
        if name in feed:
            return feed[name]
    raise OptimizerError(f"a generation needs an input named input_ids or input_features; the inputs are "
                         f"{', '.join(feed) or 'none'}")


def encoder_arrays(names: tuple[str, ...] | list[str], prompt: np.ndarray) -> list[np.ndarray]:
    """The prefill's inputs, in `names` order, for a prompt: the prompt itself, and an all-ones attention mask."""
    return [np.ones(prompt.shape, np.int64) if n == "attention_mask" else prompt for n in names]


@dataclass(frozen=True)
class Seq2SeqLayout:
    """What the loop needs to know of an encoder-decoder."""

    encoder_inputs: tuple[str, ...]  # TEXT_INPUTS or SPEECH_INPUTS
    layers: int  # decoder layers (two self-attention and two cross-attention tensors each)
    start_token: int  # decoder_start_token_id: the decoder's first input
    width: int  # d_model: the encoder states' width

    @property
    def encoder_mask(self) -> bool:
        """The decode step takes the encoder's attention mask (text: padding may be masked; speech: no mask)."""
        return "attention_mask" in self.encoder_inputs

    @staticmethod
    def of(model: Any) -> Seq2SeqLayout:
        """Read from a transformers encoder-decoder (T5ForConditionalGeneration, WhisperForConditionalGeneration).
        Raises OptimizerError when it is not one this loop knows."""
        config = model.config
        name = type(model).__name__
        if not getattr(config, "is_encoder_decoder", False):
            raise OptimizerError(f"{name} is not an encoder-decoder (config.is_encoder_decoder is not set)")
        main = getattr(model, "main_input_name", "input_ids")
        if main not in ("input_ids", *SPEECH_INPUTS):
            raise OptimizerError(f"{name}: its encoder takes {main!r}; the seq2seq loop feeds input_ids or "
                                 "input_features")
        start = getattr(config, "decoder_start_token_id", None)
        if start is None:
            start = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
        if not isinstance(start, int):
            raise OptimizerError(f"{name}: no decoder_start_token_id in its config: the decoder has no first token")
        layers = next((getattr(config, k) for k in ("decoder_layers", "num_decoder_layers", "num_layers")
                       if isinstance(getattr(config, k, None), int)), None)
        if layers is None:
            raise OptimizerError(f"{name}: its config names no decoder layer count (decoder_layers)")
        return Seq2SeqLayout(TEXT_INPUTS if main == "input_ids" else SPEECH_INPUTS, int(layers), start,
                             int(config.d_model))


def _caches(out: Any) -> tuple[list[Any], list[Any]]:
    """(self-attention K/V, cross-attention K/V) of every decoder layer from a model output's EncoderDecoderCache."""
    cache = getattr(out, "cache", None) or out.past_key_values

    def flat(part: Any) -> list[Any]:
        return [t for layer in part.layers for t in (layer.keys, layer.values)]

    return flat(cache.self_attention_cache), flat(cache.cross_attention_cache)


def seq2seq_wrappers(model: Any) -> tuple[Any, Any, Seq2SeqLayout]:
    """(prefill module, decode module, layout) around a transformers encoder-decoder.

    prefill(*encoder inputs in layout.encoder_inputs order) -> (logits [batch, vocab], *self K/V, *cross K/V);
    decode(input_ids [batch, 1], [encoder_attention_mask,] *self K/V, *cross K/V) -> (logits, *self K/V)."""
    import torch
    from transformers import DynamicCache, EncoderDecoderCache

    layout = Seq2SeqLayout.of(model)
    keyword = cache_keyword(model)
    layers = layout.layers

    class Prefill(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *encoder_inputs: Any) -> tuple[Any, ...]:
            first = encoder_inputs[0]
            start = torch.full((first.shape[0], 1), layout.start_token, dtype=torch.long, device=first.device)
            kwargs = dict(zip(layout.encoder_inputs, encoder_inputs, strict=True))
            out = self.model(**kwargs, decoder_input_ids=start, use_cache=True)  # the model builds its cache
            own, cross = _caches(out)
            return (out.logits[:, -1, :], *own, *cross)

    class Decode(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, *rest: Any) -> tuple[Any, ...]:
            mask, rest = (rest[0], rest[1:]) if layout.encoder_mask else (None, rest)
            own, cross = rest[: 2 * layers], rest[2 * layers :]
            self_cache, cross_cache = DynamicCache(), DynamicCache()
            for i in range(layers):
                self_cache.update(own[2 * i], own[2 * i + 1], i)
                cross_cache.update(cross[2 * i], cross[2 * i + 1], i)
            cache = EncoderDecoderCache(self_cache, cross_cache)  # filled cross cache: every layer reuses its K/V
            # The encoder's states are not read again (their K/V are cached), but a decoder layer attends to the
            # encoder only when they are given: zeros of their shape stand in (no node reads their values).
            states = cross[0].new_zeros((input_ids.shape[0], cross[0].shape[2], layout.width))
            extra = {"attention_mask": mask} if mask is not None else {}
            out = self.model(encoder_outputs=(states,), decoder_input_ids=input_ids, use_cache=True, **extra,
                             **{keyword: cache})
            return (out.logits[:, -1, :], *_caches(out)[0])

    return Prefill().eval(), Decode().eval(), layout


class TorchSeq2SeqGenerator:
    """The loop in PyTorch (stage 0) over seq2seq_wrappers: transformers' EncoderDecoderCache, dynamic."""

    def __init__(self, model: Any, threads: int, device: str = "cpu") -> None:
        import torch

        torch.set_num_threads(threads)
        self.device = device
        self.prefill, self.decode, self.layout = seq2seq_wrappers(model.to(device))
        self.layers = self.layout.layers

    def generate(self, prompt: np.ndarray, new_tokens: int, keep_logits: bool = True) -> Generation:
        import torch

        state: dict[str, Any] = {}
        own = 2 * self.layers

        def prefill() -> tuple[Any, np.ndarray]:
            inputs = [torch.from_numpy(a).to(self.device) for a in encoder_arrays(self.layout.encoder_inputs, prompt)]
            state["mask"] = inputs[1:] if self.layout.encoder_mask else []
            logits, *caches = self.prefill(*inputs)
            state["self"], state["cross"] = caches[:own], caches[own:]
            state["next"] = logits.argmax(-1, keepdim=True)
            return logits, state["next"][:, 0].cpu().numpy()

        def step(i: int) -> tuple[Any, np.ndarray]:
            logits, *state["self"] = self.decode(state["next"], *state["mask"], *state["self"], *state["cross"])
            state["next"] = logits.argmax(-1, keepdim=True)
            return logits, state["next"][:, 0].cpu().numpy()

        with torch.inference_mode():
            return greedy_loop(prompt.shape[0], new_tokens, prefill, step, torch_snapshot if keep_logits else None)

    def describe(self) -> dict[str, Any]:
        return dict(DESCRIPTION)


def is_seq2seq_session(decode: Any) -> bool:
    """Whether an ONNX Runtime decode session is an encoder-decoder's: it takes cross-attention K/V."""
    return any(i.name.startswith("cross.") for i in decode.get_inputs())


class OrtSeq2SeqGenerator:
    """The same loop over the prefill and decode sessions, on numpy arrays. The cross-attention K/V (and T5's
    encoder mask) are bound once per generation as fixed inputs; only the self-attention cache goes round."""

    def __init__(self, prefill: Any, decode: Any, layers: int) -> None:
        self.prefill, self.decode, self.layers = prefill, decode, layers
        self.encoder_inputs = [i.name for i in prefill.get_inputs()]
        unknown = set(self.encoder_inputs) - {*TEXT_INPUTS, *SPEECH_INPUTS}
        if unknown:
            raise OptimizerError(f"the prefill graph takes {', '.join(sorted(unknown))}: not an encoder input the "
                                 "seq2seq loop feeds")
        self.encoder_mask = ENCODER_MASK in {i.name for i in decode.get_inputs()}
        self.names = cache_names(layers)
        self.cross = cross_names(layers)
        self.decode_outputs = ["logits"] + [p for _, p in self.names]
        self.prefill_outputs = self.decode_outputs + self.cross

    def generate(self, prompt: np.ndarray, new_tokens: int, keep_logits: bool = True) -> Generation:
        state: dict[str, Any] = {}
        own = 2 * self.layers

        def prefill() -> tuple[np.ndarray, np.ndarray]:
            feed = dict(zip(self.encoder_inputs, encoder_arrays(self.encoder_inputs, prompt), strict=True))
            logits, *caches = self.prefill.run(self.prefill_outputs, feed)
            state["self"] = caches[:own]
            state["fixed"] = dict(zip(self.cross, caches[own:], strict=True))  # the same every step
            if self.encoder_mask:
                state["fixed"][ENCODER_MASK] = feed["attention_mask"]
            state["next"] = logits.argmax(-1)[:, None].astype(np.int64)
            return logits, state["next"][:, 0]

        def step(i: int) -> tuple[np.ndarray, np.ndarray]:
            feed = {"input_ids": state["next"], **state["fixed"]}
            feed.update({past: value for (past, _), value in zip(self.names, state["self"], strict=True)})
            logits, *state["self"] = self.decode.run(self.decode_outputs, feed)
            state["next"] = logits.argmax(-1)[:, None].astype(np.int64)
            return logits, state["next"][:, 0]

        return greedy_loop(prompt.shape[0], new_tokens, prefill, step, (lambda x: x) if keep_logits else None)

    def describe(self) -> dict[str, Any]:
        return dict(DESCRIPTION)
