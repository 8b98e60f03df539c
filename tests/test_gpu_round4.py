"""Issue 46 (GPU path, round 4): each defect's test, with the device pieces injected on the CPU as
tests/test_gpu_check.py and tests/test_gpu_injected.py do. None needs a GPU."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_decisive  # noqa: E402


# ---------------------------------------------------------------- 1: a verdict covers only what ran
def _summary_with_rows_not_run() -> dict[str, Any]:
    data = gpu_decisive.template()
    data["decode"]["status"] = "pass"
    data["replay_010"]["static_decode"]["status"] = "pass"
    data["replay_010"]["pytorch_forward"]["status"] = "pass"
    for row in ("pytorch_eager", "pytorch_captured"):
        data["timing_labels"][row]["status"] = "pass"
    reason = "onnxruntime has no CUDAExecutionProvider"
    for row in ("ort_cuda", "ort_cuda_captured"):
        data["timing_labels"][row] = gpu_decisive.fill(data["timing_labels"][row], reason)
    data["replay_010"]["ort_cuda_graph"] = gpu_decisive.fill(data["replay_010"]["ort_cuda_graph"], reason)
    for row in ("tensorrt", "tensorrt_captured"):
        data["timing_labels"][row] = gpu_decisive.fill(data["timing_labels"][row], "tensorrt is not installed")
    data["replay_010"]["tensorrt_graph"] = gpu_decisive.fill(data["replay_010"]["tensorrt_graph"],
                                                             "tensorrt is not installed")
    return gpu_decisive.fill(data, "not measured")


def test_verdict_never_says_pass_for_rows_that_did_not_run() -> None:
    verdict = gpu_decisive.verdict(_summary_with_rows_not_run())
    assert verdict != "pass"
    assert verdict.startswith("pass for what ran"), verdict
    assert "not run: " in verdict and "ort_cuda" in verdict and "tensorrt" in verdict
    assert "onnxruntime has no CUDAExecutionProvider" in verdict and "tensorrt is not installed" in verdict


def test_verdict_is_plain_pass_only_when_every_row_ran() -> None:
    data = _summary_with_rows_not_run()
    for key in ("ort_cuda", "ort_cuda_captured", "tensorrt", "tensorrt_captured"):
        data["timing_labels"][key]["status"] = "pass"
    for key in ("ort_cuda_graph", "tensorrt_graph"):
        data["replay_010"][key]["status"] = "pass"
    data["gpu_tests"] = "3 passed in 2.0s"
    assert gpu_decisive.verdict(data) == "pass"


def test_the_gpu_machines_plan_says_which_rows_cannot_run_there() -> None:
    """The GPU machine we can borrow has PyTorch 2.11 (CUDA 13), a CPU-only onnxruntime 1.30, no TensorRT,
    Polygraphy or onnxruntime-gpu: its ORT CUDA and TensorRT rows are "not run: <why>", the PyTorch ones run."""
    plan = gpu_decisive.gpu_machine_plan()
    runs = {k for k, v in plan.items() if v == "runs"}
    assert {"decode", "replay_010.static_decode", "replay_010.pytorch_forward", "timing_labels.pytorch_eager",
            "timing_labels.pytorch_captured"} <= runs
    for key in ("timing_labels.ort_cuda", "timing_labels.ort_cuda_captured", "replay_010.ort_cuda_graph"):
        assert plan[key].startswith("not run: ") and "onnxruntime" in plan[key], key
    for key in ("timing_labels.tensorrt", "timing_labels.tensorrt_captured", "replay_010.tensorrt_graph"):
        assert plan[key].startswith("not run: ") and "TensorRT" in plan[key], key


# ---------------------------------------------------------------- 12: a run cut off still brings its log back
def hang() -> str:
    """GPU_CHECK_INJECT=test_gpu_round4:hang: a check that never ends, as one stopped by the machine's limit."""
    import time

    print("ROUND4-MARKER: the checks started", flush=True)
    time.sleep(120)
    return "never"


def test_a_run_cut_off_mid_way_leaves_its_log_in_the_output_folder(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import time

    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_INJECT": "test_gpu_round4:hang",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-run", str(out)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            log = out / "log.txt"
            if log.is_file() and "ROUND4-MARKER" in log.read_text(errors="replace"):
                break
            time.sleep(0.5)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the machine's own limit: everything goes, no trap runs
        proc.wait()
    assert (out / "log.txt").is_file(), "no log.txt in the output folder of a run cut off"
    assert "ROUND4-MARKER" in (out / "log.txt").read_text(errors="replace")


# ---------------------------------------------------------------- 13: carry only what the machine lacks
def test_only_the_wheels_the_machine_lacks_are_unpacked(tmp_path: Path) -> None:
    for name in ("pytest-8.3.0-py3-none-any.whl", "pyyaml-6.0-cp312-cp312-manylinux_2_17_x86_64.whl",
                 "zz_round4_absent-1.0-py3-none-any.whl", "Zz.Round4-Other-2.0-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    missing = {Path(p).name for p in gpu_decisive.missing_wheels(sorted(tmp_path.glob("*.whl")))}
    assert missing == {"zz_round4_absent-1.0-py3-none-any.whl", "Zz.Round4-Other-2.0-py3-none-any.whl"}


def test_the_wheelhouse_fetches_nothing_the_gpu_machine_has_or_cannot_use() -> None:
    text = (ROOT / "scripts/gpu_wheelhouse.sh").read_text()
    packages = text[text.index("for pkg in"):text.index("; do")].split()
    for present in ("scipy", "pytest", "pluggy", "iniconfig", "pyyaml", "polygraphy", "onnx-graphsurgeon"):
        assert present not in packages, present
    check = (ROOT / "scripts/gpu_check.sh").read_text()
    assert "--missing-wheels" in check  # and gpu_check.sh unpacks only the wheels missing there


# ---------------------------------------------------------------- 2: int8_static for TensorRT keeps float biases
def _gemm_with_bias(path: Path, width: int = 16) -> Path:
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(width, width)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(size=(width,)).astype(np.float32), "b")]
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], transB=1, name="gemm"),
             helper.make_node("Relu", ["g"], ["y"], name="relu")]
    graph = helper.make_graph(nodes, "gemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, width])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_int8_static_for_a_cuda_target_leaves_biases_in_float_so_tensorrt_takes_it(tmp_path: Path) -> None:
    import numpy as np
    import onnx

    from optimizer.runtime.gpu.profiles import asymmetric_qdq_reason
    from passes.quantize.calibration import FeedReader
    from passes.quantize.config import quantize_bias
    from passes.quantize.modes import int8_static

    assert quantize_bias("cuda") is False and quantize_bias("cpu") is True
    src = _gemm_with_bias(tmp_path / "gemm.onnx")
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.normal(size=(2, 16)).astype(np.float32)} for _ in range(4)]
    dst = tmp_path / "q.onnx"
    int8_static(src, dst, FeedReader(feeds, ["x"]), "minmax", True, True, ["Gemm"], [], 99.99,
                quantize_bias=quantize_bias("cuda"))
    model = onnx.load(str(dst))
    assert sum(n.op_type == "QuantizeLinear" for n in model.graph.node) >= 1  # quantized, and
    assert asymmetric_qdq_reason(model) is None  # TensorRT takes it
    biased = tmp_path / "qb.onnx"  # the CPU's form: int32 bias; the skip says what it is, not "symmetric_activations"
    int8_static(src, biased, FeedReader(feeds, ["x"]), "minmax", True, True, ["Gemm"], [], 99.99)
    reason = asymmetric_qdq_reason(onnx.load(str(biased)))
    assert reason is not None and "bias" in reason and "symmetric_activations" not in reason, reason


# ---------------------------------------------------------------- 11: the Q/DQ TensorRT takes
def _qdq(kind: int | None, zero: bool = True, op: str = "DequantizeLinear", data_kind: int | None = None) -> Any:
    """One Q or DQ node; `kind` the zero point's type (None: no zero point), `data_kind` a DQ's input type."""
    import numpy as np
    from onnx import TensorProto, helper

    inits = [helper.make_tensor("s", TensorProto.FLOAT, [], [0.1])]
    inputs = ["x", "s"]
    if kind is not None:
        inits.append(helper.make_tensor("zp", kind, [], [0 if zero else 3]))
        inputs.append("zp")
    graph_inputs = []
    if op == "DequantizeLinear" and data_kind is not None:
        inits.append(helper.make_tensor("x", data_kind, [4], np.zeros(4, np.int64).tolist()))
    else:
        graph_inputs.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]))
    node = helper.make_node(op, inputs, ["y"], name="q")
    graph = helper.make_graph([node], "g", graph_inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_symmetric_int8_fp8_and_int4_qdq_are_what_tensorrt_takes() -> None:
    from onnx import TensorProto as T

    from optimizer.runtime.gpu.profiles import asymmetric_qdq_reason

    assert asymmetric_qdq_reason(_qdq(None, data_kind=T.INT8)) is None  # symmetric INT8 weights, no zero point
    assert asymmetric_qdq_reason(_qdq(T.FLOAT8E4M3FN)) is None  # FP8 (the H100's format; ModelOpt emits it)
    assert asymmetric_qdq_reason(_qdq(T.FLOAT8E4M3FN, op="QuantizeLinear")) is None
    assert asymmetric_qdq_reason(_qdq(T.INT4, data_kind=T.INT4)) is None  # INT4 weight-only
    assert asymmetric_qdq_reason(_qdq(T.INT8, op="QuantizeLinear")) is None
    uint8 = asymmetric_qdq_reason(_qdq(None, op="QuantizeLinear"))  # no zero point: uint8 output
    assert uint8 is not None and "uint8" in uint8
    assert "zero point" in (asymmetric_qdq_reason(_qdq(T.INT8, zero=False, op="QuantizeLinear")) or "")
    assert "uint8" in (asymmetric_qdq_reason(_qdq(T.UINT8, op="QuantizeLinear")) or "")
