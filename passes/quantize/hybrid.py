"""Hybrid precision: INT8 where it is harmless, high precision where it is not, under an accuracy budget.

Sensitivity of node n = 1 - cosine(output of the input graph, output with only n quantized to INT8), on the
calibration inputs (never on the inputs the stage is judged on). Nodes are then quantized least sensitive
first: the search finds the largest k for which quantizing the k least sensitive nodes keeps the cosine at or
above the budget plus a margin (bisection, each step a real quantized model), then also times k and a few
smaller sets, because more INT8 is not always faster (each quantized op adds quantize/dequantize work), and
keeps the fastest set within budget. Every point tried (k, cosine, latency) is saved, so the trade-off can be
seen. When no set meets the budget, the stage keeps every node in the input's precision and says so.
The high-precision side is FP32 on the CPU, where FP16 is slower than FP32.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.benchmark import time_calls
from optimizer.runners.ort_runner import session_options
from passes.quantize.modes import int8_dynamic


@dataclass
class Search:
    budget: float
    margin: float
    sensitivity: dict[str, float] = field(default_factory=dict)
    points: list[dict[str, Any]] = field(default_factory=list)


class Evaluator:
    """Runs candidate models on the search inputs and compares the judged output with the reference."""

    def __init__(
        self, src: Path, feeds: list[dict[str, np.ndarray]], output: str | None, runtime: dict[str, Any], threads: int
    ) -> None:
        self.feeds, self.runtime, self.threads = feeds, runtime, threads
        session = self._session(src)
        names = [o.name for o in session.get_outputs()]
        self.index = names.index(output) if output in names else 0
        self.reference = [session.run(None, self._feed(session, f))[self.index] for f in feeds]

    def _session(self, path: Path) -> Any:
        import onnxruntime as ort

        so = session_options(self.runtime, self.threads)
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    @staticmethod
    def _feed(session: Any, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {i.name: feed[i.name] for i in session.get_inputs()}

    def cosine(self, path: Path, timed: bool = False) -> tuple[float, float | None]:
        session = self._session(path)
        worst = 1.0
        for ref, f in zip(self.reference, self.feeds, strict=True):
            got = session.run(None, self._feed(session, f))[self.index]
            a, b = ref.astype(np.float64).ravel(), got.astype(np.float64).ravel()
            worst = min(worst, float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-30)))
        latency = None
        if timed:

            class _S:  # the harness's timing loop over a bare ORT session
                def run(self, prepared: Any) -> Any:
                    return session.run(None, prepared)

            feed = self._feed(session, self.feeds[0])
            time_calls(_S(), feed, 3)  # type: ignore[arg-type]
            latency = float(np.median(time_calls(_S(), feed, 15)))  # type: ignore[arg-type]
        return worst, latency


def search(
    src: Path,
    work: Path,
    nodes: list[str],
    evaluator: Evaluator,
    search_state: Search,
    per_channel: bool,
    ops: list[str],
    progress: Any,
) -> list[str]:
    """The INT8 node set chosen (possibly empty); fills search_state."""
    total = len(nodes)
    for i, node in enumerate(nodes):
        path = work / "single.onnx"
        int8_dynamic(src, path, per_channel, ops, [node], [])
        cos, _ = evaluator.cosine(path)
        search_state.sensitivity[node] = 1.0 - cos
        progress("sensitivity per node", i + 1, total)
    order = sorted(nodes, key=lambda n: search_state.sensitivity[n])
    target = search_state.budget + search_state.margin
    tried: dict[int, tuple[float, float | None]] = {}

    def point(k: int) -> tuple[float, float | None]:
        if k not in tried:
            path = work / f"k{k}.onnx"
            int8_dynamic(src, path, per_channel, ops, order[:k], [])
            tried[k] = evaluator.cosine(path, timed=True)
            search_state.points.append({"int8_nodes": k, "cosine": tried[k][0], "latency_ms": tried[k][1]})
            progress("searching INT8 sets", len(tried), len(tried) + 3)
        return tried[k]

    lo, hi = 0, total  # invariant: lo meets the target (0 = nothing quantized), hi unknown
    if point(total)[0] >= target:
        lo = total
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if point(mid)[0] >= target:
                lo = mid
            else:
                hi = mid
    if lo == 0:
        return []
    for k in {max(1, lo - step) for step in (total // 8, total // 4)}:
        point(k)
    ok = [(lat, k) for k, (cos, lat) in tried.items() if cos >= target and lat is not None]
    best_k = min(ok)[1] if ok else lo
    shutil.copyfile(work / f"k{best_k}.onnx", work / "chosen.onnx")
    return order[:best_k]
