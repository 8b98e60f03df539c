"""PyTorch eager runner (stage 0, the reference). FP32, inference mode, the recipe's thread count.

On CUDA (target.device: cuda) inputs are placed on the device in `prepare` and outputs stay there, so the timed
`run` is compute plus launch overhead only; copies are measured apart (`transfer_ms`). Each call is bracketed
by CUDA events, so GPU time is reported beside host latency. With the artifact's runtime option cuda_graph,
one graph per input shape is captured after a warm-up on a side stream and `run` replays it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from optimizer.runtime.runners.base import Runner, Session
from optimizer.runtime.threads import target_threads


class TorchSession(Session):
    def __init__(
        self,
        module: Any,
        output_names: list[str],
        input_names: list[str],
        threads: int,
        device: str = "cpu",
        cuda_graph: bool = False,
    ) -> None:
        self.module = module
        self.output_names = output_names
        self.input_names = input_names
        self.threads = threads
        self.device = device
        self.cuda_graph = cuda_graph
        self.device_time = device == "cuda"
        self._events: Any = None
        self._graphs: dict[tuple[Any, ...], Any] = {}

    def prepare(self, feed: dict[str, np.ndarray]) -> Any:
        import torch

        tensors = [torch.from_numpy(np.ascontiguousarray(feed[n])).to(self.device) for n in self.input_names]
        if self.cuda_graph:
            return self._capture(tensors)
        return tensors

    def _capture(self, tensors: list[Any]) -> Any:
        """Warm up on a side stream, capture once per shape. A graph replays from the buffers it was captured with,
        so each prepared feed keeps its own tensors and `run` copies them into the shape's static inputs first
        (a device-to-device copy, as a server feeding a captured graph does); without it a second feed of a
        captured shape would replay the first feed's inputs. The static inputs are clones, never the first feed's
        own tensors: were they the same, that feed's later runs would skip the copy and replay whatever feed was
        copied in last (call order 0, 1, 0)."""
        import torch

        key = tuple(tuple(t.shape) for t in tensors)
        if key not in self._graphs:
            static = [t.clone() for t in tensors]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(3):
                    self.module(*static)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.inference_mode():
                outputs = self.module(*static)
            self._graphs[key] = (graph, static, outputs)
        return ("graph", key, tensors)

    def run(self, prepared: Any) -> Any:
        import torch

        if self.device_time:
            if self._events is None:
                self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        if isinstance(prepared, tuple) and prepared and prepared[0] == "graph":
            graph, static, outputs = self._graphs[prepared[1]]
            for buffer, value in zip(static, prepared[2], strict=True):
                buffer.copy_(value)
            graph.replay()
        else:
            with torch.inference_mode():
                outputs = self.module(*prepared)
        if self.device_time:
            self._events[1].record()
            torch.cuda.synchronize()  # host latency includes the wait for the GPU: what a caller sees
        return outputs

    def last_device_ms(self) -> float:
        return float(self._events[0].elapsed_time(self._events[1]))

    def transfer_ms(self, feed: dict[str, np.ndarray]) -> dict[str, float]:
        """Host->device copy of the inputs and device->host copy of the outputs, timed apart from compute."""
        import torch

        t0 = time.perf_counter()
        tensors = [torch.from_numpy(np.ascontiguousarray(feed[n])).to(self.device) for n in self.input_names]
        torch.cuda.synchronize()
        h2d = (time.perf_counter() - t0) * 1000
        with torch.inference_mode():
            outputs = self.module(*tensors)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for o in outputs:
            o.cpu()
        return {"h2d_ms": h2d, "d2h_ms": (time.perf_counter() - t0) * 1000}

    def to_numpy(self, outputs: Any) -> list[np.ndarray]:
        return [
            o.detach().float().cpu().numpy() if o.is_floating_point() else o.detach().cpu().numpy() for o in outputs
        ]

    def describe(self) -> dict[str, Any]:
        import torch

        d: dict[str, Any] = {
            "runtime": "pytorch-eager",
            "torch": torch.__version__,
            "threads": self.threads,
            "dtype": "fp32",
            "device": self.device,
        }
        if self.device == "cuda":
            d.update(cuda_graph=self.cuda_graph, transfers="excluded from timing (measured apart)")
        return d


class TorchRunner(Runner):
    def _open(self) -> Session:
        import torch

        from optimizer.core.errors import OptimizerError
        from optimizer.runtime.gpu import cuda_reason
        from optimizer.runtime.models import NamedIO, load_module

        threads = target_threads(self.recipe)
        torch.set_num_threads(threads)
        device = self.target_device
        if device == "cuda" and cuda_reason() is not None:
            raise OptimizerError(f"target.device: cuda, but {cuda_reason()}")
        inputs = self.artifact.input_names
        outputs = self.artifact.output_names
        module = NamedIO.wrap(load_module(self.recipe), inputs, outputs).to(device)
        return TorchSession(module, outputs, inputs, threads, device, bool(self.artifact.runtime.get("cuda_graph")))
