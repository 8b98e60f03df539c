"""GPU runner logic checked on the CPU by injecting the device pieces: a graph whose replay reads the buffers it was
captured with, streams that record what ran on them. Each fails on the defect it pins (issue: GPU path correct
before it meets a GPU); the true-GPU versions are the gpu-marked tests in test_gpu_logic.py."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from optimizer.runners.torch_runner import TorchSession
from optimizer.runners.trt_runner import TrtSession

CAPTURING: list[Any] = []  # the graph being captured, if any


class FakeStream:
    def __init__(self, name: str = "side") -> None:
        self.name = name

    def wait_stream(self, other: Any) -> None:
        pass


class FakeGraph:
    """Replays what was captured: a closure over the static buffers, read at replay time, as CUDA graphs do."""

    def __init__(self) -> None:
        self.work: list[Any] = []
        self.replayed_on: list[Any] = []

    def replay(self) -> None:
        self.replayed_on.append(CURRENT[-1])
        with torch.inference_mode():  # the captured kernels write tensors made under inference mode
            for fn in self.work:
                fn()


CURRENT: list[Any] = [FakeStream("default")]


@contextlib.contextmanager
def fake_graph_capture(graph: FakeGraph, stream: Any = None) -> Any:
    CAPTURING.append(graph)
    try:
        yield
    finally:
        CAPTURING.pop()


@contextlib.contextmanager
def fake_stream_ctx(stream: Any) -> Any:
    CURRENT.append(stream)
    try:
        yield
    finally:
        CURRENT.pop()


class Doubler(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if CAPTURING:
            out = torch.empty_like(x)
            CAPTURING[-1].work.append(lambda: out.copy_(x * 2))  # reads the static buffer x when replayed
            return [out]
        return [x * 2]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: CURRENT[-1])
    monkeypatch.setattr(torch.cuda, "stream", fake_stream_ctx)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", fake_graph_capture)


def test_second_feed_of_a_captured_shape_is_not_the_first_feeds_output(fake_cuda: None) -> None:
    session = TorchSession(Doubler(), ["y"], ["x"], 1, device="cpu", cuda_graph=True)
    a, b = np.full((2, 3), 1.0, np.float32), np.full((2, 3), 5.0, np.float32)
    pa, pb = session.prepare({"x": a}), session.prepare({"x": b})
    assert len(session._graphs) == 1  # one capture for the shape
    np.testing.assert_array_equal(session.to_numpy(session.run(pb))[0], 2 * b)
    np.testing.assert_array_equal(session.to_numpy(session.run(pa))[0], 2 * a)


class FakeEvent:
    def __init__(self, **_: Any) -> None:
        self.streams: list[Any] = []

    def record(self, stream: Any = None) -> None:
        self.streams.append(stream)


def test_tensorrt_graph_replays_on_the_stream_its_events_time(fake_cuda: None) -> None:
    session = TrtSession.__new__(TrtSession)  # no engine needed: run() is what is checked
    session.torch = SimpleNamespace(cuda=SimpleNamespace(stream=fake_stream_ctx))
    session.stream = SimpleNamespace(name="trt", synchronize=lambda: None)
    session._events = (FakeEvent(), FakeEvent())
    graph = FakeGraph()
    session.run({"graph": graph, "inputs": {}, "outputs": {}})
    assert graph.replayed_on == [session.stream]
    assert session._events[0].streams == [session.stream] == session._events[1].streams
