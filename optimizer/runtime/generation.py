"""Generation workloads: a greedy decoding loop with an explicit KV cache, in PyTorch and in ONNX Runtime.

Two graphs serve one loop: prefill (the prompt -> last-position logits + the KV cache) and decode (one token
+ the cache -> logits + the grown cache). Both return only the last position's logits (`logits_to_keep=1`), in
PyTorch as in ONNX, so stage 0 and the exported stages do the same work. Decoding is greedy and runs exactly
`new_tokens` steps (no early stop at EOS), so every stage times the same amount of work.

Timings per generation: time to first token (prefill + the first argmax), time per output token (each
decode step), end-to-end time of the task (prompt + all new tokens), and tokens/s over the whole task.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from optimizer.core.errors import OptimizerError


@dataclass
class Generation:
    tokens: np.ndarray  # [batch, new_tokens]
    step_logits: list[np.ndarray] = field(default_factory=list)  # new_tokens x [batch, vocab]
    ttft_ms: float = 0.0
    tpot_ms: list[float] = field(default_factory=list)
    e2e_ms: float = 0.0


def cache_names(layers: int) -> list[tuple[str, str]]:
    """(past input name, present output name) for every key and value of every layer, in order."""
    return [(f"past.{i}.{k}", f"present.{i}.{k}") for i in range(layers) for k in ("key", "value")]


def _flatten_cache(out: Any) -> list[Any]:
    cache = getattr(out, "cache", None) or out.past_key_values
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def cache_keyword(model: Any) -> str:
    """The keyword a transformers model's forward takes its KV cache by: `cache` from transformers 5.24,
    `past_key_values` before it. Passing the wrong one is silent: it falls into **kwargs, the model builds a cache
    of its own, and a static cache is never filled. Read from the forward's signature, not the version."""
    import inspect

    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise OptimizerError(f"{type(model).__name__}.forward takes its KV cache by neither `cache` nor "
                         "`past_key_values`: this transformers version is not one the generation loop knows")


def wrappers(model: Any) -> tuple[Any, Any, int]:
    """(prefill module, decode module, layers) around a transformers causal LM."""
    import torch
    from transformers import DynamicCache

    layers = int(model.config.num_hidden_layers)
    keyword = cache_keyword(model)

    class Prefill(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any) -> tuple[Any, ...]:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1)
            return (out.logits[:, -1, :], *_flatten_cache(out))

    class Decode(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids: Any, attention_mask: Any, *past: Any) -> tuple[Any, ...]:
            cache = DynamicCache()
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            out = self.model(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=True, logits_to_keep=1, **{keyword: cache}
            )
            return (out.logits[:, -1, :], *_flatten_cache(out))

    return Prefill().eval(), Decode().eval(), layers


Step = Callable[[int], tuple[Any, np.ndarray]]  # step index -> (logits, next tokens [batch] on the host)


def greedy_loop(
    batch: int, new_tokens: int, prefill: Callable[[], tuple[Any, np.ndarray]], step: Step, snapshot: Any = None
) -> Generation:
    """The one timed loop every runtime shares: TTFT is prefill until the first token is on the host, TPOT each
    step until its token is, e2e the whole task. `snapshot(logits)` copies a step's logits (None: keep none); it
    runs inside the timing, the conversion to numpy after it."""
    gen = Generation(np.zeros((batch, new_tokens), np.int64))
    kept: list[Any] = []
    start = time.perf_counter_ns()
    logits, gen.tokens[:, 0] = prefill()
    gen.ttft_ms = (time.perf_counter_ns() - start) / 1e6
    if snapshot is not None:
        kept.append(snapshot(logits))
    for i in range(1, new_tokens):
        t0 = time.perf_counter_ns()
        logits, gen.tokens[:, i] = step(i)
        gen.tpot_ms.append((time.perf_counter_ns() - t0) / 1e6)
        if snapshot is not None:
            kept.append(snapshot(logits))
    gen.e2e_ms = (time.perf_counter_ns() - start) / 1e6
    gen.step_logits = [np.asarray(x.cpu().numpy() if hasattr(x, "cpu") else x) for x in kept]
    return gen


def torch_snapshot(logits: Any) -> Any:
    """A device copy: a captured graph overwrites its logits buffer on the next replay."""
    return logits.float().clone()


class TorchGenerator:
    """The loop in PyTorch with transformers' growing (dynamic) cache, on the CPU or a CUDA device. Each token is
    copied to the host as it is produced (what streaming needs, and a sync on CUDA), so times are host-visible."""

    def __init__(self, model: Any, threads: int, device: str = "cpu") -> None:
        import torch

        torch.set_num_threads(threads)
        self.device = device
        self.prefill, self.decode, self.layers = wrappers(model.to(device))

    def generate(self, prompt: np.ndarray, new_tokens: int, keep_logits: bool = True) -> Generation:
        import torch

        batch, seq = prompt.shape
        state: dict[str, Any] = {}

        def prefill() -> tuple[Any, np.ndarray]:
            ids = torch.from_numpy(prompt).to(self.device)
            logits, *state["cache"] = self.prefill(ids, torch.ones_like(ids))
            state["next"] = logits.argmax(-1, keepdim=True)
            return logits, state["next"][:, 0].cpu().numpy()

        def step(i: int) -> tuple[Any, np.ndarray]:
            mask = torch.ones((batch, seq + i), dtype=torch.long, device=self.device)
            logits, *state["cache"] = self.decode(state["next"], mask, *state["cache"])
            state["next"] = logits.argmax(-1, keepdim=True)
            return logits, state["next"][:, 0].cpu().numpy()

        with torch.inference_mode():
            return greedy_loop(batch, new_tokens, prefill, step, torch_snapshot if keep_logits else None)


class OrtGenerator:
    """The same loop over two ONNX Runtime sessions; the cache goes back in as numpy arrays each step. On the CPU
    IO binding is no faster (benchmarks/bench_generation_layout.py), so the CPU keeps this plain path."""

    def __init__(self, prefill: Any, decode: Any, layers: int) -> None:
        self.prefill, self.decode, self.names = prefill, decode, cache_names(layers)
        self.outputs = ["logits"] + [p for _, p in self.names]

    def _run(self, session: Any, host: dict[str, np.ndarray], cache: list[Any]) -> tuple[np.ndarray, list[Any]]:
        """One session call: (logits on the host, the cache as the next call takes it)."""
        feed = {**host, **{past: value for (past, _), value in zip(self.names if cache else [], cache, strict=True)}}
        logits, *present = session.run(self.outputs, feed)
        return logits, present

    def forward(self, ids: np.ndarray, mask: np.ndarray, cache: list[Any]) -> tuple[np.ndarray, list[Any]]:
        """One call with the caller's attention mask (generate's, or a padded batch's): the prefill graph when
        `cache` is empty, else the decode graph. Returns the last position's logits and the cache."""
        session = self.decode if cache else self.prefill
        return self._run(session, {"input_ids": ids, "attention_mask": mask}, cache)

    def generate(self, prompt: np.ndarray, new_tokens: int, keep_logits: bool = True) -> Generation:
        batch, seq = prompt.shape
        state: dict[str, Any] = {}

        def call(ids: np.ndarray, length: int, cache: list[Any]) -> tuple[np.ndarray, np.ndarray]:
            logits, state["cache"] = self.forward(ids, np.ones((batch, length), np.int64), cache)
            state["next"] = logits.argmax(-1)[:, None].astype(np.int64)
            return logits, state["next"][:, 0]

        return greedy_loop(
            batch,
            new_tokens,
            lambda: call(prompt, seq, []),
            lambda i: call(state["next"], seq + i, state["cache"]),
            (lambda x: x) if keep_logits else None,
        )


class OrtBoundGenerator(OrtGenerator):
    """The loop with IO binding: the KV cache stays where the execution provider put it (device memory on CUDA)
    and goes back in as the same OrtValues; only the token ids, the mask and the logits cross to the host. Used
    for the CUDA EP, where copying the cache through numpy each step would be most of the step; the same code
    runs on the CPU, which is how it is tested here."""

    def __init__(self, prefill: Any, decode: Any, layers: int, device: str) -> None:
        super().__init__(prefill, decode, layers)
        self.device = device

    def _run(self, session: Any, host: dict[str, np.ndarray], cache: list[Any]) -> tuple[np.ndarray, list[Any]]:
        binding = session.io_binding()
        for name, value in host.items():
            binding.bind_cpu_input(name, value)
        for (past, _), value in zip(self.names if cache else [], cache, strict=True):  # prefill: no cache in
            binding.bind_ortvalue_input(past, value)
        binding.bind_output("logits", "cpu")  # [batch, vocab]: the host needs it for the argmax anyway
        for _, present in self.names:
            binding.bind_output(present, self.device)
        session.run_with_iobinding(binding)
        logits, *present = binding.get_outputs()
        return logits.numpy(), present
