"""ONNX Runtime GenAI's own generation loop (the yardstick runtime) over a folder it serves: greedy, exactly
`new` tokens, each read back to the host, with a timestamp per token. One loop for the bundle check
(deploy/genai_bundle.py) and the comparison script (scripts/compare_genai.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class GenaiGeneration:
    tokens: np.ndarray  # [new]
    start_ns: int
    marks_ns: list[int]  # when each token was on the host
    logits: list[np.ndarray] = field(default_factory=list)  # per step, before its token (keep_logits only)

    @property
    def e2e_ms(self) -> float:
        return (self.marks_ns[-1] - self.start_ns) / 1e6

    @property
    def ttft_ms(self) -> float:
        return (self.marks_ns[0] - self.start_ns) / 1e6

    @property
    def tpot_ms(self) -> list[float]:
        return list(np.diff(self.marks_ns) / 1e6)


def genai_generate(model: Any, prompt: np.ndarray, new: int, keep_logits: bool = False) -> GenaiGeneration:
    """One greedy generation of `new` tokens by GenAI's runtime (`model`: an og.Model) for a [1, seq] prompt.
    The timing covers generator creation, the prompt and every token, as a user's loop would."""
    import onnxruntime_genai as og

    total = prompt.shape[1] + new
    logits: list[np.ndarray] = []
    tokens: list[int] = []
    marks: list[int] = []
    start = time.perf_counter_ns()
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=total, min_length=total, do_sample=False, batch_size=1)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt.astype(np.int32))
    while len(tokens) < new and not gen.is_done():
        if keep_logits:
            logits.append(np.array(gen.get_logits()).reshape(-1))
        gen.generate_next_token()
        tokens.append(int(gen.get_next_tokens()[0]))
        marks.append(time.perf_counter_ns())
    return GenaiGeneration(np.array(tokens, np.int64), start, marks, logits)
