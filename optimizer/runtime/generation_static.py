"""Greedy decoding over a static KV cache: the decode step that CUDA graphs can capture.

A dynamic cache grows by one position per token, so every decode step has new shapes and new buffers, and a
captured graph (fixed shapes, fixed addresses) cannot replay it. Here the cache is transformers' StaticCache,
preallocated at prompt + new_tokens positions and written in place; its fill level is a device tensor. Each
decode step reads the same buffers (the token, the cache, the fill level) and derives everything else on the
device: position = fill level, attention mask = positions <= fill level. Nothing in the step reads a value
back to the host, so the step can be captured once per (batch, cache length) and replayed for every token.

Without cuda_graph the same step runs eagerly (on the CPU too), which is how its tokens are tested against
transformers' generate here; with cuda_graph on a CUDA device the step is captured after a warm-up on a side
stream and replayed. Every token is copied to the host as it is produced, as a streaming server (and
transformers' generate, which checks stop conditions each step) does, so per-token times are host-visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from optimizer.core.errors import OptimizerError
from optimizer.runtime.generation import Generation, cache_keyword, greedy_loop, torch_snapshot

MASK_FORMS = ("sdpa", "eager")  # attention implementations whose 4-D mask format this module builds
# ATen ops that read a tensor's value back to the host (a sync on CUDA, fatal inside graph capture): Python
# int()/float()/bool() on a tensor, .item(), torch.equal, and ops whose output shape depends on the data.
HOST_READS = frozenset(
    {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "unique", "_unique2"}
)


def host_reads(fn: Any, *args: Any) -> tuple[int, list[str]]:
    """Run fn under a dispatch mode that sees every ATen op: (ops run, the host-reading ones among them).

    Checks on the CPU what CUDA graph capture needs of a decode step; torch.compile(fullgraph=True) is not
    such a check (it traces int(tensor) and .item() without complaint)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops.append(func._schema.name.split("::")[-1])
            return func(*args, **(kwargs or {}))

    with Record() as rec:
        fn(*args)
    return len(rec.ops), sorted({op for op in rec.ops if op in HOST_READS})


@dataclass
class _Buffers:
    """Everything one (batch, cache length) shape keeps at fixed addresses across steps and generations."""

    cache: Any  # transformers.StaticCache
    ids: Any  # [batch, 1] int64: the token fed to the next step, overwritten by the step itself
    positions: Any  # [cache length] int64: 0..L-1, compared with the fill level to mask unwritten slots
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    logits: Any = None  # the captured step's output buffer


class StaticCacheGenerator:
    def __init__(self, model: Any, threads: int, device: str = "cpu", cuda_graph: bool = False) -> None:
        import torch

        torch.set_num_threads(threads)
        self.attn = getattr(model.config, "_attn_implementation", None) or "eager"
        if self.attn not in MASK_FORMS:
            raise OptimizerError(
                f"static KV cache: attention implementation {self.attn!r} is not supported "
                f"(set model.attn_implementation to one of {', '.join(MASK_FORMS)})"
            )
        if cuda_graph and device != "cuda":
            raise OptimizerError("static KV cache: cuda_graph needs target.device: cuda")
        self.model = model.to(device).eval()
        self.cache_keyword = cache_keyword(self.model)
        self.device, self.cuda_graph = device, cuda_graph
        self._buffers: dict[tuple[int, int], _Buffers] = {}
        self.captures = 0  # graphs captured so far (one per shape): tests and the report read it

    def _buffers_for(self, batch: int, length: int) -> _Buffers:
        import torch
        from transformers import StaticCache

        key = (batch, length)
        if key not in self._buffers:
            self._buffers[key] = _Buffers(
                cache=StaticCache(config=self.model.config, max_cache_len=length),
                ids=torch.zeros((batch, 1), dtype=torch.long, device=self.device),
                positions=torch.arange(length, device=self.device),
            )
        return self._buffers[key]

    def _mask(self, visible: Any) -> Any:
        """The model's 4-D mask from a boolean [batch, 1, q, L] "may attend" tensor (sdpa: bool; eager: additive)."""
        import torch

        if self.attn == "sdpa":
            return visible
        zero = torch.zeros((), dtype=self.model.dtype, device=self.device)
        return torch.where(visible, zero, torch.finfo(self.model.dtype).min)

    def _prefill(self, buf: _Buffers, prompt: Any) -> Any:
        batch, seq = prompt.shape
        query = buf.positions[:seq].view(1, 1, seq, 1)
        visible = (buf.positions.view(1, 1, 1, -1) <= query).expand(batch, 1, seq, -1)
        out = self.model(
            input_ids=prompt,
            attention_mask=self._mask(visible),
            position_ids=buf.positions[:seq].view(1, -1).expand(batch, -1),
            **{self.cache_keyword: buf.cache},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def _step(self, buf: _Buffers) -> Any:
        """One decode step, device-only: reads buf.ids and the fill level, writes the cache and buf.ids."""
        batch = buf.ids.shape[0]
        filled = buf.cache.layers[0].cumulative_length  # tokens in the cache; the new one goes at this index
        position = filled.reshape(1, 1).expand(batch, 1).clone()  # cloned: the cache advances it in place
        visible = (buf.positions.view(1, 1, 1, -1) <= position.view(batch, 1, 1, 1)).expand(batch, 1, 1, -1)
        out = self.model(
            input_ids=buf.ids,
            attention_mask=self._mask(visible),
            position_ids=position,
            **{self.cache_keyword: buf.cache},
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :]
        buf.ids.copy_(logits.argmax(-1, keepdim=True))
        return logits

    def _capture(self, buf: _Buffers) -> None:
        """Warm up on a side stream (allocator, cuBLAS handles), put the state back, capture one step."""
        import torch

        saved = [layer.cumulative_length.clone() for layer in buf.cache.layers], buf.ids.clone()

        def restore() -> None:
            for layer, filled in zip(buf.cache.layers, saved[0], strict=True):
                layer.cumulative_length.copy_(filled)
            buf.ids.copy_(saved[1])

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(buf)  # writes slots past the fill level: masked now, overwritten by the real steps
        torch.cuda.current_stream().wait_stream(stream)
        restore()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            buf.logits = self._step(buf)
        restore()
        buf.graph = graph
        self.captures += 1

    def generate(self, prompt: np.ndarray, new_tokens: int, keep_logits: bool = True) -> Generation:
        import torch

        batch, seq = prompt.shape

        def prefill() -> tuple[Any, np.ndarray]:
            logits = self._prefill(buf, torch.from_numpy(prompt).to(self.device))
            buf.ids.copy_(logits.argmax(-1, keepdim=True))
            if self.cuda_graph and buf.graph is None and new_tokens > 1:
                self._capture(buf)  # first generation of this shape only (the benchmark's warm-up)
            return logits, buf.ids[:, 0].cpu().numpy()

        def step(i: int) -> tuple[Any, np.ndarray]:
            if buf.graph is not None:
                buf.graph.replay()
                logits = buf.logits
            else:
                logits = self._step(buf)
            return logits, buf.ids[:, 0].cpu().numpy()

        with torch.inference_mode():
            buf = self._buffers_for(batch, seq + new_tokens)
            buf.cache.reset()  # in place: the buffers keep their addresses, so a captured graph stays valid
            return greedy_loop(batch, new_tokens, prefill, step, torch_snapshot if keep_logits else None)

    def step_host_reads(self, prompt: np.ndarray) -> tuple[int, list[str]]:
        """Prefill the prompt, then run one decode step under host_reads: (ops in the step, host-reading ops)."""
        import torch

        batch, seq = prompt.shape
        with torch.inference_mode():
            buf = self._buffers_for(batch, seq + 2)
            buf.cache.reset()
            buf.ids.copy_(self._prefill(buf, torch.from_numpy(prompt).to(self.device)).argmax(-1, keepdim=True))
            return host_reads(self._step, buf)

    def describe(self) -> dict[str, Any]:
        return {"kv_cache": "static", "cuda_graph": self.cuda_graph, "graphs_captured": self.captures}
