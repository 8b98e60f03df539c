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

from optimizer.errors import OptimizerError
from optimizer.runners.base import Runner, Session


class TrtSession(Session):
    device_time = True

    def __init__(self, engine: Any, runtime: dict[str, Any]) -> None:
        import tensorrt as trt
        import torch

        self.trt, self.torch = trt, torch
        self.engine = engine
        self.context = engine.create_execution_context()
        self.runtime = runtime
        self.stream = torch.cuda.Stream()
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.input_names = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def _dtype(self, name: str) -> Any:
        return getattr(self.torch, np.dtype(self.trt.nptype(self.engine.get_tensor_dtype(name))).name)

    def prepare(self, feed: dict[str, np.ndarray]) -> Any:
        torch = self.torch
        inputs = {
            n: torch.from_numpy(np.ascontiguousarray(feed[n])).to("cuda").to(self._dtype(n)) for n in self.input_names
        }
        for n, t in inputs.items():
            self.context.set_input_shape(n, tuple(t.shape))
        outputs = {
            n: torch.empty(tuple(self.context.get_tensor_shape(n)), dtype=self._dtype(n), device="cuda")
            for n in self.output_names
        }
        graph = None
        if self.runtime.get("cuda_graph"):
            self._bind(inputs, outputs)
            self.context.execute_async_v3(self.stream.cuda_stream)  # warm-up enqueue after the shape change
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                self.context.execute_async_v3(self.stream.cuda_stream)
        return {"inputs": inputs, "outputs": outputs, "graph": graph}

    def _bind(self, inputs: dict[str, Any], outputs: dict[str, Any]) -> None:
        for n, t in inputs.items():
            self.context.set_input_shape(n, tuple(t.shape))
            self.context.set_tensor_address(n, t.data_ptr())
        for n, t in outputs.items():
            self.context.set_tensor_address(n, t.data_ptr())

    def run(self, prepared: Any) -> Any:
        self._events[0].record(self.stream)
        if prepared["graph"] is not None:
            # replay() launches on the current stream: make it the stream the events and the sync are on, or
            # run() returns before the work ends and the GPU time reads about zero.
            with self.torch.cuda.stream(self.stream):
                prepared["graph"].replay()
        else:
            self._bind(prepared["inputs"], prepared["outputs"])
            if not self.context.execute_async_v3(self.stream.cuda_stream):
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
        from optimizer.gpu import tensorrt_reason

        reason = tensorrt_reason()
        if reason is not None:
            raise OptimizerError(f"cannot run a TensorRT engine here: {reason}")
        import tensorrt as trt

        assert self.artifact.path is not None
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        engine = runtime.deserialize_cuda_engine(self.artifact.path.read_bytes())
        if engine is None:
            raise OptimizerError(
                f"{self.artifact.path}: TensorRT could not deserialize the engine "
                "(built by another TensorRT version or for another GPU?)"
            )
        return TrtSession(engine, self.artifact.runtime)
