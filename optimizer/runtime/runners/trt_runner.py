"""TensorRT runner: a serialized engine, run with execute_async_v3 on torch-allocated device buffers.

Written for TensorRT 10 and 11 (the runtime API used here is the same in both). Inputs are copied to the
device in `prepare` (one set of buffers per scenario shape), outputs stay on the device, so `run` times the
enqueue and the GPU work only. With the runtime option cuda_graph the enqueue is captured once per shape
into a CUDA graph and replayed (what trtexec --useCudaGraph does).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from optimizer.core.errors import OptimizerError
from optimizer.runtime.runners.base import Runner, Session


class TrtSession(Session):
    device_time = True

    def __init__(self, engine: Any, runtime: dict[str, Any]) -> None:
        import tensorrt as trt
        import torch

        self.trt, self.torch = trt, torch
        self.engine = engine
        self.context = engine.create_execution_context()
        self.runtime = runtime
        self.device = "cuda"
        self._graphs: dict[Any, Any] = {}  # input shapes -> (context, static inputs, outputs, graph)
        self.stream = torch.cuda.Stream()
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.input_names = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def _dtype(self, name: str) -> Any:
        """The torch dtype of an engine tensor, by TensorRT's type name (trt.nptype has no bfloat16)."""
        kind = self.engine.get_tensor_dtype(name).name
        torch = self.torch
        table = {
            "FLOAT": torch.float32,
            "HALF": torch.float16,
            "BF16": torch.bfloat16,
            "INT8": torch.int8,
            "UINT8": torch.uint8,
            "INT32": torch.int32,
            "INT64": torch.int64,
            "BOOL": torch.bool,
        }
        if kind not in table:
            raise OptimizerError(f"TensorRT engine: tensor {name!r} has type {kind}, which this runner does not feed")
        return table[kind]

    def prepare(self, feed: dict[str, np.ndarray]) -> Any:
        """Inputs on the device (awaited before any timing), outputs allocated for their shape. With cuda_graph,
        one execution context, static buffers and graph per input shape: a context holds one shape, and a graph
        replays the buffers and the shape it was captured with, so `run` copies each feed into them first."""
        torch = self.torch
        inputs = {
            n: torch.from_numpy(np.ascontiguousarray(feed[n])).to(self.device).to(self._dtype(n))
            for n in self.input_names
        }
        if not self.runtime.get("cuda_graph"):
            outputs = self._outputs(self.context, inputs)
            self._sync()
            return {"inputs": inputs, "outputs": outputs, "graph": None, "context": self.context}
        key = tuple((n, tuple(t.shape)) for n, t in inputs.items())
        if key not in self._graphs:
            context = self.engine.create_execution_context()
            static = {n: t.clone() for n, t in inputs.items()}
            outputs = self._outputs(context, static)
            self._bind(context, static, outputs)
            self._sync()
            context.execute_async_v3(self.stream.cuda_stream)  # warm-up enqueue after the shape change
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                context.execute_async_v3(self.stream.cuda_stream)
            self._graphs[key] = (context, static, outputs, graph)
        context, static, outputs, graph = self._graphs[key]
        self._sync()
        return {"inputs": inputs, "static": static, "outputs": outputs, "graph": graph, "context": context}

    def _sync(self) -> None:
        """Copies made on the default stream are finished before self.stream (which does not wait for it) runs."""
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def _outputs(self, context: Any, inputs: dict[str, Any]) -> dict[str, Any]:
        for n, t in inputs.items():
            if not context.set_input_shape(n, tuple(t.shape)):
                raise OptimizerError(
                    f"TensorRT engine: input {n!r} of shape {tuple(t.shape)} is outside the engine's optimization "
                    "profile (rebuild with a profile that spans every scenario)"
                )
        return {
            n: self.torch.empty(tuple(context.get_tensor_shape(n)), dtype=self._dtype(n), device=self.device)
            for n in self.output_names
        }

    def _bind(self, context: Any, inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
        for n, t in inputs.items():
            context.set_input_shape(n, tuple(t.shape))
            context.set_tensor_address(n, t.data_ptr())
        for n, t in outputs.items():
            context.set_tensor_address(n, t.data_ptr())

    def run(self, prepared: Any) -> Any:
        if prepared["graph"] is None:  # host-side setup (shapes, addresses): outside the event span
            self._bind(prepared["context"], prepared["inputs"], prepared["outputs"])
        self._events[0].record(self.stream)
        if prepared["graph"] is not None:
            # Both on the stream the events and the sync are on: replay() launches on the current stream, and
            # a replay elsewhere would return before the work ends (GPU time about zero).
            with self.torch.cuda.stream(self.stream):
                for n, t in prepared["inputs"].items():
                    if prepared["static"][n] is not t:
                        prepared["static"][n].copy_(t, non_blocking=True)
                prepared["graph"].replay()
        else:
            if not prepared["context"].execute_async_v3(self.stream.cuda_stream):
                raise OptimizerError("TensorRT execute_async_v3 failed")
        self._events[1].record(self.stream)
        self.stream.synchronize()
        return prepared["outputs"]

    def last_device_ms(self) -> float:
        return float(self._events[0].elapsed_time(self._events[1]))

    def to_numpy(self, outputs: Any) -> list[np.ndarray]:
        return [
            outputs[n].float().cpu().numpy() if outputs[n].is_floating_point() else outputs[n].cpu().numpy()
            for n in self.output_names
        ]

    def transfer_ms(self, feed: dict[str, np.ndarray]) -> dict[str, float]:
        torch = self.torch
        t0 = time.perf_counter()
        prepared = self.prepare(feed)
        torch.cuda.synchronize()
        h2d = (time.perf_counter() - t0) * 1000
        self.run(prepared)
        t0 = time.perf_counter()
        for t in prepared["outputs"].values():
            t.cpu()
        return {"h2d_ms": h2d, "d2h_ms": (time.perf_counter() - t0) * 1000}

    def describe(self) -> dict[str, Any]:
        return {
            "runtime": "tensorrt",
            "tensorrt": self.trt.__version__,
            "device": "cuda",
            "cuda_graph": bool(self.runtime.get("cuda_graph")),
            "transfers": "excluded from timing (measured apart)",
        }


class TrtRunner(Runner):
    def _open(self) -> Session:
        from optimizer.runtime.gpu import tensorrt_reason

        reason = tensorrt_reason()
        if reason is not None:
            raise OptimizerError(f"cannot run a TensorRT engine here: {reason}")
        from polygraphy.backend.trt import EngineFromPath
        from polygraphy.exception import PolygraphyException

        from optimizer.core.quiet import silence_polygraphy

        silence_polygraphy()
        assert self.artifact.path is not None
        try:  # Polygraphy's loader: TensorRT's runtime, its plugins, the engine read as a stream
            engine = EngineFromPath(str(self.artifact.path))()
        except PolygraphyException:
            engine = None
        if engine is None:
            raise OptimizerError(
                f"{self.artifact.path}: TensorRT could not deserialize the engine "
                "(built by another TensorRT version or for another GPU?)"
            )
        return TrtSession(engine, self.artifact.runtime)
