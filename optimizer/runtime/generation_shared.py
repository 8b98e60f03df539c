"""The greedy loop over a decoder in ONNX Runtime GenAI's layout: one graph for prefill and decode, attention as
GroupQueryAttention with the rotary embedding inside, and a KV cache that is one buffer per tensor, preallocated
to the generation's whole length (prompt + new tokens) and written in place.

The past input and the present output of each cache tensor are bound (IO binding) to the same OrtValue, which
is how GroupQueryAttention knows to append the new keys and values in place (its kernel compares the two
pointers): no step copies the cache, so a step's time does not grow with the prompt as the concatenating layout's
does. The attention mask has the current total length; the graph derives each row's sequence length from it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.errors import OptimizerError
from optimizer.runtime.generation import Generation, greedy_loop


@dataclass(frozen=True)
class GenaiLayout:
    """What the loop needs from a GenAI model folder's genai_config.json."""

    layers: int
    kv_heads: int
    head_size: int
    context_length: int
    past: list[str]  # past_key_values.{i}.key / .value, in the cache's order
    present: list[str]

    @staticmethod
    def read(config_path: Path) -> GenaiLayout:
        try:
            cfg = json.loads(config_path.read_text())
            dec = cfg["model"]["decoder"]
            layers, names, outs = int(dec["num_hidden_layers"]), dec["inputs"], dec["outputs"]
            past = [names[f"past_{k}_names"] % i for i in range(layers) for k in ("key", "value")]
            present = [outs[f"present_{k}_names"] % i for i in range(layers) for k in ("key", "value")]
            return GenaiLayout(
                layers=layers,
                kv_heads=int(dec["num_key_value_heads"]),
                head_size=int(dec["head_size"]),
                context_length=int(cfg["model"]["context_length"]),
                past=past,
                present=present,
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise OptimizerError(f"{config_path}: not a GenAI model config ({type(e).__name__}: {e})") from None


class SharedBufferGenerator:
    """The loop over one ONNX Runtime session of a GenAI-layout graph, the cache bound in place."""

    def __init__(self, session: Any, layout: GenaiLayout) -> None:
        self.session, self.layout = session, layout
        self.layers = layout.layers
        self.cache: list[Any] = []  # the last generation's KV buffers (past and present alike)
        self.dtype = next((_np_type(i.type) for i in session.get_inputs() if i.name == layout.past[0]), np.float32)
        logits = next((o for o in session.get_outputs() if o.name == "logits"), None)
        if logits is None or not isinstance(logits.shape[-1], int):
            raise OptimizerError("a GenAI-layout graph needs a 'logits' output with a fixed vocabulary size")
        self.vocab, self.logits_dtype = int(logits.shape[-1]), _np_type(logits.type)

    def generate(self, prompt: np.ndarray, new_tokens: int, keep_logits: bool = True) -> Generation:
        import onnxruntime as ort

        batch, seq = prompt.shape
        total = seq + new_tokens
        if total > self.layout.context_length:
            raise OptimizerError(
                f"prompt {seq} + {new_tokens} new tokens exceed the model's context length {self.layout.context_length}"
            )
        shape = (batch, self.layout.kv_heads, total, self.layout.head_size)
        binding = self.session.io_binding()
        self.cache = [ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, self.dtype)) for _ in self.layout.past]
        for past, present, buffer in zip(self.layout.past, self.layout.present, self.cache, strict=True):
            binding.bind_ortvalue_input(past, buffer)
            binding.bind_ortvalue_output(present, buffer)  # the same memory: appended in place
        # Host buffers bound by address, so a decode step rebinds nothing but the mask's length: the next token is
        # written into `step_ids`, the logits land in `step_logits`, the mask is a prefix of one row of ones.
        mask = np.ones((batch, total), np.int64)
        step_ids = np.zeros((batch, 1), np.int64)
        step_logits = np.empty((batch, 1, self.vocab), self.logits_dtype)

        def bind(name: str, array: np.ndarray, shape: tuple[int, ...], output: bool = False) -> None:
            bind_fn = binding.bind_output if output else binding.bind_input
            bind_fn(name, "cpu", 0, array.dtype, list(shape), array.ctypes.data)

        # A decode step's own work between two runs is what GenAI's C++ loop does not pay: the mask's pointer,
        # the device and the raw binding are looked up once, not per step (each lookup costs tens of
        # microseconds on caches the run just evicted).
        rebind_mask, run = _fast_calls(self.session, binding)
        mask_ptr, flat_logits = mask.ctypes.data, step_logits.reshape(batch, -1)

        def prefill() -> tuple[np.ndarray, np.ndarray]:
            ids = np.ascontiguousarray(prompt, np.int64)
            binding.bind_cpu_input("input_ids", ids)
            binding.bind_cpu_input("attention_mask", np.ascontiguousarray(mask[:, :seq]))
            binding.bind_output("logits", "cpu")  # [batch, seq, vocab], or [batch, 1, vocab] with a pruned head
            self.session.run_with_iobinding(binding)
            logits = binding.get_outputs()[-1].numpy()[:, -1, :]
            step_ids[:, 0] = logits.argmax(-1)
            bind("input_ids", step_ids, step_ids.shape)
            bind("logits", step_logits, step_logits.shape, output=True)
            return logits, step_ids[:, 0].copy()

        def step(i: int) -> tuple[np.ndarray, np.ndarray]:
            length = seq + i
            if batch == 1:  # a prefix of one row is contiguous: bound in place
                rebind_mask(mask_ptr, length)
            else:
                binding.bind_cpu_input("attention_mask", np.ascontiguousarray(mask[:, :length]))
            run()
            step_ids[:, 0] = flat_logits.argmax(-1)
            return flat_logits, step_ids[:, 0].copy()

        return greedy_loop(batch, new_tokens, prefill, step, (lambda x: x.copy()) if keep_logits else None)


def _np_type(ort_type: str) -> Any:
    return {"tensor(float16)": np.float16, "tensor(float)": np.float32}.get(ort_type, np.float32)


def _fast_calls(session: Any, binding: Any) -> tuple[Any, Any]:
    """(rebind_mask(pointer, length), run()) for a batch-1 decode step: ONNX Runtime's C-level binding and run
    when its Python wrapper exposes them (`_iobinding`, `_sess`), else the public calls, which do the same with
    argument checks and a device lookup per call."""
    import onnxruntime as ort

    raw, sess = getattr(binding, "_iobinding", None), getattr(session, "_sess", None)
    make = getattr(getattr(ort.capi.onnxruntime_inference_collection, "OrtDevice", None), "make", None)
    if raw is None or sess is None or make is None or getattr(binding, "_session", None) is not sess:
        return (lambda ptr, length: binding.bind_input("attention_mask", "cpu", 0, np.int64, [1, length], ptr),
                lambda: session.run_with_iobinding(binding))
    device = make("cpu", 0)._get_c_device()

    def rebind_mask(ptr: int, length: int) -> None:
        raw.bind_input("attention_mask", device, np.int64, [1, length], ptr)

    def run() -> None:
        sess.run_with_iobinding(raw, None)

    return rebind_mask, run
