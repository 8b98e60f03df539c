"""ONNX Runtime's op-type profile: the warm-up run is dropped and one slow run does not inflate an op type."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from optimizer.runtime.runners.ort_runner import profile_per_run


def _run(ts: int, dur: int) -> dict:
    return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}


def _node(ts: int, op: str, dur_us: int) -> dict:
    return {"cat": "Node", "name": f"n_{op}_kernel_time", "ts": ts, "dur": dur_us, "args": {"op_name": op}}


def test_warm_up_dropped_and_a_slow_run_does_not_inflate() -> None:
    events = [_run(0, 1000), _node(10, "MatMul", 900)]  # warm-up: slow
    for k in range(1, 6):
        start = k * 10_000
        events += [_run(start, 200), _node(start + 5, "MatMul", 30), _node(start + 50, "Add", 10)]
    events += [_run(60_000, 5000), _node(60_005, "MatMul", 4000), _node(60_100, "Add", 10)]  # one run slowed
    per_op, kernels = profile_per_run(events)
    assert per_op["MatMul"] == 0.03  # the median of 5 x 0.03 ms and one 4 ms: not the mean (0.69)
    assert per_op["Add"] == 0.01
    assert kernels == 2
    assert list(per_op) == ["MatMul", "Add"]


def test_real_profile_has_the_runs_it_needs(tmp_path) -> None:
    """ORT's own profile marks each run with a model_run event (the grouping above relies on it)."""
    import onnxruntime as ort

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])],
                              "g", [x], [y])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "p")
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    for _ in range(4):
        session.run(None, {"x": np.ones((4, 8), np.float32)})
    import json
    from pathlib import Path

    events = json.loads(Path(session.end_profiling()).read_text())
    per_op, kernels = profile_per_run(events)
    assert set(per_op) == {"Relu", "Neg"}
    assert kernels == 2
