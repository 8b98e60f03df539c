"""ONNX Runtime runner (CPU here; the CUDA EP comes with the GPU stages).

Runtime options read from the artifact:
  graph_optimization_level: disable_all | basic | extended | all. The export stage is measured with
    disable_all; the `ort_session` stage turns ORT's own optimizations on, so their gain is its own.
  execution_mode: sequential | parallel; inter_op_threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.errors import OptimizerError
from optimizer.runtime.denormals import denormal_settings
from optimizer.runtime.runners.base import Runner, Session
from optimizer.runtime.sessions import ort_session
from optimizer.runtime.threads import target_threads


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
            "threads": int(self.runtime.get("intra_op_threads") or self.threads),
            "allow_spinning": self.runtime.get("allow_spinning", "onnxruntime's default"),
            **({"disabled_optimizers": d} if (d := self.runtime.get("disabled_optimizers")) else {}),
            **denormal_settings(self.runtime),
        }


class OrtCudaSession(OrtSession):
    """CUDA EP with IO binding: inputs copied to the device once in `prepare`, outputs bound on the device, so
    `run` times compute only; with cuda_graph, ORT captures on the first runs and replays after (fixed buffers).
    The CUDA event span comes from events recorded on the session's own stream, which is the stream ORT computes
    on (`user_compute_stream`, providers_for); runs are asked not to synchronize (ORT's
    disable_synchronize_execution_providers), so the end event follows the last kernel, not the host's wait, and
    the host's own synchronize after it is what host latency includes."""

    device_time = True
    stream: Any = None  # the session's torch.cuda.Stream (OrtRunner gives it)
    device_name = "cuda"  # where feeds and captured buffers live (tests inject "cpu")

    @staticmethod
    def _run_options(graph_id: int | None = None) -> Any:
        import onnxruntime as ort

        options = ort.RunOptions()
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        if graph_id is not None:
            options.add_run_config_entry("gpu_graph_id", str(graph_id))
        return options

    def prepare(self, feed: dict[str, np.ndarray]) -> Any:
        """Without cuda_graph: the feed on the device, outputs bound there (one binding per feed). With it: one
        CUDA graph per input shape, each under its own `gpu_graph_id`, over static input buffers and its own
        binding, and this feed on the device beside them; `run` copies it into them (device to device, on the
        compute stream, inside the span) and replays. The parent's feeds are on the device too, so both sides of
        a ratio start from device memory."""
        import onnxruntime as ort

        feed = super().prepare(feed)
        if self.runtime.get("cuda_graph"):
            return self._graph_for(feed)
        binding = self.session.io_binding()
        keep = []
        for name, arr in feed.items():
            value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr), "cuda", 0)
            keep.append(value)
            binding.bind_ortvalue_input(name, value)
        for name in self.output_names:
            binding.bind_output(name, "cuda", 0)
        self.session.run_with_iobinding(binding)  # allocates the outputs
        return (binding, keep, self._run_options())

    def _graph_for(self, feed: dict[str, np.ndarray]) -> Any:
        import torch

        graphs: dict[Any, Any] = self.__dict__.setdefault("_graphs", {})
        key = tuple((n, a.shape, a.dtype.str) for n, a in feed.items())
        own = {n: torch.from_numpy(np.ascontiguousarray(a)).to(self.device_name) for n, a in feed.items()}
        if key not in graphs:
            options = self._run_options(graph_id=len(graphs) + 1)  # 0 is ORT's default id
            binding = self.session.io_binding()
            static = {n: t.clone() for n, t in own.items()}  # never a feed's own tensors (call order 0, 1, 0)
            for name, t in static.items():
                binding.bind_input(name, "cuda", 0, feed[name].dtype, list(t.shape), t.data_ptr())
            for name in self.output_names:
                binding.bind_output(name, "cuda", 0)
            torch.cuda.synchronize()  # the copies above ran on torch's stream, which ORT's does not wait for
            for _ in range(2):  # ORT warms up, then captures on a later run
                self.session.run_with_iobinding(binding, options)
            torch.cuda.synchronize()
            graphs[key] = (binding, static, options)
        binding, static, options = graphs[key]
        torch.cuda.synchronize()
        return (binding, static, own, options)

    def run(self, prepared: Any) -> Any:
        import torch

        if not hasattr(self, "_events"):
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._events[0].record(self.stream)
        if len(prepared) == 4:  # a captured shape: this feed into its static buffers, then replay
            binding, static, values, options = prepared
            with torch.cuda.stream(self.stream):
                for name, value in values.items():
                    static[name].copy_(value, non_blocking=True)
        else:
            binding, _, options = prepared
        self.session.run_with_iobinding(binding, options)
        self._events[1].record(self.stream)
        torch.cuda.synchronize()
        return binding

    def last_device_ms(self) -> float:
        return float(self._events[0].elapsed_time(self._events[1]))

    def to_numpy(self, outputs: Any) -> list[np.ndarray]:
        return list(outputs.copy_outputs_to_cpu())

    def transfer_ms(self, feed: dict[str, np.ndarray]) -> dict[str, float]:
        import time

        import onnxruntime as ort

        t0 = time.perf_counter()
        for arr in super().prepare(feed).values():
            ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(arr), "cuda", 0)
        h2d = (time.perf_counter() - t0) * 1000
        binding = self.run(self.prepare(feed))
        t0 = time.perf_counter()
        binding.copy_outputs_to_cpu()
        return {"h2d_ms": h2d, "d2h_ms": (time.perf_counter() - t0) * 1000}

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "io_binding": True,
            "cuda_graph": bool(self.runtime.get("cuda_graph")),
            "transfers": "host-device copies excluded from timing (measured apart); a captured graph's feed is "
            "copied device to device into its buffers inside the call",
        }


# The CUDA provider and run option keys this module passes to onnxruntime-gpu; tests/test_api_surface.py checks
# each against the GPU wheel's own binaries (an unknown key is ignored or rejected at run time, on a GPU only).
class OrtRunner(Runner):
    """device: None = the recipe's target; "cpu" for numeric checks inside passes, which must run anywhere."""

    def _open(self) -> Session:
        threads = target_threads(self.recipe)
        device = self.target_device
        if device != "cuda":
            return OrtSession(ort_session(self.artifact.path, self.artifact.runtime, threads), self.artifact.runtime,
                              threads)
        import torch

        stream = torch.cuda.Stream()  # ORT computes on it and the timing events are recorded on it
        session = OrtCudaSession(
            ort_session(self.artifact.path, self.artifact.runtime, threads, device, compute_stream=stream.cuda_stream),
            self.artifact.runtime, threads,
        )
        session.stream = stream
        return session


TOP_NODES = 40  # nodes kept by name per profile (the slowest): per-node times of every node would bloat metrics


@dataclass
class RunProfile:
    """ONNX Runtime's profile of one feed, per run (median over the profiled runs, the warm-up dropped)."""

    ops: dict[str, float]  # ms per op type, slowest first
    kernels: int  # node kernels a run executed
    nodes: dict[str, float] = field(default_factory=dict)  # ms per node name, the TOP_NODES slowest, slowest first
    node_ops: dict[str, str] = field(default_factory=dict)  # node name -> op type, for the nodes kept
    node_total_ms: float = 0.0  # every node's ms per run
    node_count: int = 0  # distinct nodes that ran
    names: list[str] = field(default_factory=list)  # every node that ran (for new/gone, matched by name)


def op_time_breakdown(
    artifact: Any, recipe: Any, feed: dict[str, np.ndarray], runs: int = 10
) -> tuple[dict[str, float], int]:
    """Milliseconds per run spent in each op type, from ONNX Runtime's profiler (its per-node kernel times).

    A separate, profiled session: profiling adds overhead, so these numbers never mix with the timed ones.
    """
    prof = profile_feeds(artifact, recipe, [feed], runs)[0]
    return prof.ops, prof.kernels


def profile_feeds(artifact: Any, recipe: Any, feeds: list[dict[str, np.ndarray]], runs: int = 10) -> list[RunProfile]:
    """One profiled session (separate from the timed one), each feed run 1 + `runs` times in turn: per feed, op
    types and nodes per run (profile_runs), from one profile file."""
    import json
    import os
    import tempfile

    threads = target_threads(recipe)
    with tempfile.TemporaryDirectory() as tmp:
        runtime = {**artifact.runtime, "cuda_graph": False}
        session = ort_session(
            artifact.path, runtime, threads, recipe.target.device, profile_prefix=os.path.join(tmp, "profile")
        )
        names = [i.name for i in session.get_inputs()]
        for feed in feeds:
            inputs = {n: feed[n] for n in names}
            for _ in range(runs + 1):  # the first: a warm-up, profiled too, dropped by profile_runs
                session.run(None, inputs)
        events = json.loads(Path(session.end_profiling()).read_text())
    return [profile_runs(part) for part in split_runs(events, runs + 1)]


def split_runs(events: list[dict[str, Any]], per_feed: int) -> list[list[dict[str, Any]]]:
    """The profile's events cut into consecutive groups of `per_feed` runs (model_run events in time order): one
    group per feed that was run `per_feed` times in turn."""
    runs = sorted((ev["ts"], ev["ts"] + ev.get("dur", 0)) for ev in events if ev.get("name") == "model_run")
    groups = [runs[i : i + per_feed] for i in range(0, len(runs), per_feed)]
    out = []
    for group in groups:
        start, end = group[0][0], group[-1][1]
        out.append([ev for ev in events if start <= ev.get("ts", -1) <= end])
    return out


def profile_per_run(events: list[dict[str, Any]]) -> tuple[dict[str, float], int]:
    """Per op type, the median over the profiled runs (the first, a warm-up, dropped) of its kernel milliseconds in
    one run; and the median count of kernels a run executed. A median, not a mean: one run slowed by another
    process on the machine must not make a 0.03 ms op look like 0.8 ms."""
    prof = profile_runs(events)
    return prof.ops, prof.kernels


def _median_per_key(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for run in runs for k in run}
    medians = {k: float(np.median([run.get(k, 0.0) for run in runs])) for k in keys}
    return dict(sorted(medians.items(), key=lambda kv: (-kv[1], kv[0])))


def profile_runs(events: list[dict[str, Any]], top: int = TOP_NODES) -> RunProfile:
    """profile_per_run's op types, and the same per node (ORT names each node's event "<node>_kernel_time"): the
    `top` slowest by name with their op types, and every node's name and total."""
    runs = sorted((ev["ts"], ev["ts"] + ev.get("dur", 0)) for ev in events if ev.get("name") == "model_run")
    per_run: list[dict[str, float]] = [{} for _ in runs]
    per_node: list[dict[str, float]] = [{} for _ in runs]
    node_ops: dict[str, str] = {}
    counts = [0 for _ in runs]
    for ev in events:
        name = ev.get("name", "")
        if ev.get("cat") != "Node" or not name.endswith("_kernel_time"):
            continue
        i = next((k for k, (start, end) in enumerate(runs) if start <= ev.get("ts", -1) <= end), None)
        if i is None:
            continue
        op = ev.get("args", {}).get("op_name", "?")
        ms = ev.get("dur", 0) / 1000.0
        node = name.removesuffix("_kernel_time")
        per_run[i][op] = per_run[i].get(op, 0.0) + ms
        per_node[i][node] = per_node[i].get(node, 0.0) + ms
        node_ops[node] = op
        counts[i] += 1
    drop = 1 if len(runs) > 1 else 0
    kept, kept_nodes, kept_counts = per_run[drop:], per_node[drop:], counts[drop:]
    if not kept:
        return RunProfile({}, 0)
    nodes = _median_per_key(kept_nodes)
    slowest = dict(list(nodes.items())[:top])
    return RunProfile(
        ops=_median_per_key(kept),
        kernels=round(float(np.median(kept_counts))),
        nodes=slowest,
        node_ops={n: node_ops[n] for n in slowest},
        node_total_ms=float(sum(nodes.values())),
        node_count=len(nodes),
        names=sorted(nodes),
    )
