"""ONNX Runtime runner (CPU here; the CUDA EP comes with the GPU stages).

Runtime options read from the artifact:
  graph_optimization_level: disable_all | basic | extended | all. The export stage is measured with
    disable_all; the `ort_session` stage turns ORT's own optimizations on, so their gain is its own.
  execution_mode: sequential | parallel; inter_op_threads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from optimizer.errors import OptimizerError
from optimizer.runners.base import Runner, Session
from optimizer.threads import target_threads

LEVELS = ("disable_all", "basic", "extended", "all")


def session_options(runtime: dict[str, Any], threads: int, optimized_path: str | None = None) -> Any:
    import onnxruntime as ort

    level = runtime.get("graph_optimization_level", "disable_all")
    so = ort.SessionOptions()
    so.graph_optimization_level = {
        "disable_all": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = int(runtime.get("inter_op_threads", 1))
    so.execution_mode = (
        ort.ExecutionMode.ORT_PARALLEL
        if runtime.get("execution_mode") == "parallel"
        else ort.ExecutionMode.ORT_SEQUENTIAL
    )
    so.log_severity_level = 3
    if optimized_path:
        so.optimized_model_filepath = optimized_path
    return so


class OrtSession(Session):
    def __init__(self, session: Any, runtime: dict[str, Any], threads: int) -> None:
        self.session = session
        self.runtime = runtime
        self.threads = threads
        self.output_names = [o.name for o in session.get_outputs()]
        self.input_names = [i.name for i in session.get_inputs()]

    def prepare(self, feed: dict[str, np.ndarray]) -> Any:
        missing = [n for n in self.input_names if n not in feed]
        if missing:
            raise OptimizerError(f"inputs: the ONNX model needs {missing} but the recipe gives {sorted(feed)}")
        return {n: feed[n] for n in self.input_names}

    def run(self, prepared: Any) -> Any:
        return self.session.run(self.output_names, prepared)

    def to_numpy(self, outputs: Any) -> list[np.ndarray]:
        return list(outputs)

    def describe(self) -> dict[str, Any]:
        import onnxruntime as ort

        return {
            "runtime": "onnxruntime",
            "onnxruntime": ort.__version__,
            "providers": self.session.get_providers(),
            "graph_optimization_level": self.runtime.get("graph_optimization_level", "disable_all"),
            "execution_mode": self.runtime.get("execution_mode", "sequential"),
            "threads": self.threads,
        }


class OrtRunner(Runner):
    def _open(self) -> Session:
        import onnxruntime as ort

        threads = target_threads(self.recipe)
        so = session_options(self.artifact.runtime, threads)
        try:
            session = ort.InferenceSession(str(self.artifact.path), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own exception types (Fail, InvalidGraph, NotImplemented)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise OptimizerError(f"{self.artifact.path}: onnxruntime cannot load it: {first}") from e
        return OrtSession(session, self.artifact.runtime, threads)


def op_time_breakdown(artifact: Any, recipe: Any, feed: dict[str, np.ndarray], runs: int = 10) -> dict[str, float]:
    """Milliseconds per run spent in each op type, from ONNX Runtime's profiler (its per-node kernel times).

    A separate, profiled session: profiling adds overhead, so these numbers never mix with the timed ones.
    """
    import json
    import os
    import tempfile

    import onnxruntime as ort

    threads = target_threads(recipe)
    so = session_options(artifact.runtime, threads)
    with tempfile.TemporaryDirectory() as tmp:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "profile")
        session = ort.InferenceSession(str(artifact.path), so, providers=["CPUExecutionProvider"])
        inputs = {i.name: feed[i.name] for i in session.get_inputs()}
        session.run(None, inputs)  # warm-up (also profiled; dropped below by counting runs)
        for _ in range(runs):
            session.run(None, inputs)
        path = session.end_profiling()
        events = json.loads(Path(path).read_text())
    totals: dict[str, float] = {}
    for ev in events:
        if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time"):
            op = ev.get("args", {}).get("op_name", "?")
            totals[op] = totals.get(op, 0.0) + ev.get("dur", 0) / 1000.0
    return {op: t / (runs + 1) for op, t in sorted(totals.items(), key=lambda kv: -kv[1])}
