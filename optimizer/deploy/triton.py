"""Triton's config.pbtxt for a bundle laid out as a Triton model repository (`export --format triton`), for the
ONNX Runtime backend (one graph: batch dim and dynamic batching from the run's batch sweep, threads, execution mode
and graph optimization level as the stage was measured) and for the OpenVINO backend (an IR: its compile options
as far as the backend takes them); each tensor's type mapped to Triton's, refused with the tensor named when
Triton has none.
"""

from __future__ import annotations

from typing import Any

from optimizer.core.errors import OptimizerError
from optimizer.report.schema import RunReport

# Triton's data types by ONNX TensorProto type name (Triton's model_config.proto DataType); FLOAT8 and other
# types Triton has no name for are refused with the tensor named, never mapped to FP32.
TRITON_TYPES = {
    "BOOL": "TYPE_BOOL",
    "UINT8": "TYPE_UINT8",
    "UINT16": "TYPE_UINT16",
    "UINT32": "TYPE_UINT32",
    "UINT64": "TYPE_UINT64",
    "INT8": "TYPE_INT8",
    "INT16": "TYPE_INT16",
    "INT32": "TYPE_INT32",
    "INT64": "TYPE_INT64",
    "FLOAT16": "TYPE_FP16",
    "FLOAT": "TYPE_FP32",
    "DOUBLE": "TYPE_FP64",
    "STRING": "TYPE_STRING",
    "BFLOAT16": "TYPE_BF16",
}
# Triton's onnxruntime backend numbers graph levels its own way: -1 basic, 1 basic + extended, 2 all disabled;
# without the field ORT's default applies (all on). See the backend's README, "Model Config Options".
TRITON_GRAPH_LEVEL = {"disable_all": 2, "basic": -1, "extended": 1, "all": None}


def pbtxt_string(text: str) -> str:
    """A string literal of protobuf's text format (Triton's config.pbtxt): quotes, backslashes and control bytes
    escaped by protobuf's own escaper, so a tensor named `a"b` stays one string."""
    from google.protobuf import text_encoding

    return '"' + text_encoding.CEscape(text, as_utf8=True) + '"'


def _param(key: str, value: object) -> str:
    """A `parameters` entry: Triton's backends read every value as a string."""
    return f"parameters {{ key: {pbtxt_string(key)} value: {{ string_value: {pbtxt_string(str(value))} }} }}"


def _tensor(name: str, data_type: str, dims: list[Any]) -> str:
    """An `input` / `output` entry; a dim that is not a number (a named or dynamic one) is -1."""
    dims_txt = ", ".join(str(d) if isinstance(d, int) else "-1" for d in dims)
    return f"  {{\n    name: {pbtxt_string(name)}\n    data_type: {data_type}\n    dims: [ {dims_txt} ]\n  }}"


def triton_config(
    name: str,
    inputs: list[dict[str, Any]],
    outputs: list[dict[str, Any]],
    report: RunReport,
    runtime: dict[str, Any],
) -> str:
    """config.pbtxt for Triton's ONNX Runtime backend; batch dim first when every input and output has one."""
    batched = all(t["shape"] and t["shape"][0] == "batch" for t in inputs + outputs)
    sweep = report.batch_sweep
    swept_max = sweep.max_batch if sweep is not None else None
    max_batch = (swept_max or max(s.batch for s in report.scenarios)) if batched else 0
    preferred = (sweep.preferred_batch if sweep is not None else None) or max_batch

    def tensor(t: dict[str, Any]) -> str:
        kind = t.get("onnx_type") or t["dtype"].upper()
        if kind not in TRITON_TYPES:
            raise OptimizerError(f"--format triton: tensor {t['name']!r} has type {kind}, which Triton has no type for")
        return _tensor(t["name"], TRITON_TYPES[kind], t["shape"][1:] if batched else t["shape"])

    level = TRITON_GRAPH_LEVEL[runtime.get("graph_optimization_level", "disable_all")]
    gpu = report.settings.device == "cuda"

    lines = [
        f"name: {pbtxt_string(name)}",
        'platform: "onnxruntime_onnx"',
        f"max_batch_size: {max_batch}",
        "input [\n" + ",\n".join(tensor(t) for t in inputs) + "\n]",
        "output [\n" + ",\n".join(tensor(t) for t in outputs) + "\n]",
        f"instance_group [ {{ count: 1, kind: {'KIND_GPU' if gpu else 'KIND_CPU'} }} ]",
        # Served as it was measured: the benchmarked threads and execution mode, not the backend's defaults.
        _param("intra_op_thread_count", int(runtime.get("intra_op_threads") or report.settings.threads)),
        _param("inter_op_thread_count", int(runtime.get("inter_op_threads", 1))),
        _param("execution_mode", 1 if runtime.get("execution_mode") == "parallel" else 0),
    ]
    if level is not None:
        lines.append(f"optimization {{ graph {{ level: {level} }} }}")
    if runtime.get("disabled_optimizers"):  # the fuse pass's kernel choice (passes/fuse/kernel_choice.py)
        names = ", ".join(runtime["disabled_optimizers"])
        lines.append(
            f"# measured with onnxruntime's {names} disabled (slower kernels on the machine it was tuned on); this "
            "backend has no setting for that, so it may fuse them again at load"
        )
    if runtime.get("denormal_as_zero"):  # ort_session's denormal_as_zero (optimizer/runtime/denormals.py)
        lines.append(
            "# measured with denormal floats flushed to zero (onnxruntime session.set_denormal_as_zero); this backend "
            "documents no parameter for it, so padded requests may run slower here than the manifest's figures"
        )
    if max_batch > 1:  # from the run's batch sweep when it has one (see optimizer/engine/sweep.py)
        lines.append(f"dynamic_batching {{ preferred_batch_size: [ {preferred} ] max_queue_delay_microseconds: 100 }}")
    return "\n".join(lines) + "\n"


# OpenVINO element type names -> Triton's data types
TRITON_OV_TYPES = {"boolean": "TYPE_BOOL", "u8": "TYPE_UINT8", "i8": "TYPE_INT8", "i32": "TYPE_INT32",
                   "i64": "TYPE_INT64", "f16": "TYPE_FP16", "f32": "TYPE_FP32", "f64": "TYPE_FP64", "bf16": "TYPE_BF16"}


def triton_openvino_config(
    name: str, inputs: list[dict[str, Any]], outputs: list[dict[str, Any]], runtime: dict[str, Any], threads: int
) -> str:
    """config.pbtxt for Triton's OpenVINO backend: no Triton batching (its README reports crashes in batching mode;
    every dim as the IR has it, -1 where dynamic) and the compile options the stage was measured with, as far as
    the backend takes them (PERFORMANCE_HINT, INFERENCE_NUM_THREADS, NUM_STREAMS, HINT_BF16)."""

    def tensor(t: dict[str, Any]) -> str:
        if t["dtype"] not in TRITON_OV_TYPES:
            raise OptimizerError(f"--format triton: tensor {t['name']!r} has type {t['dtype']}, which Triton has no "
                                 "type for")
        return _tensor(t["name"], TRITON_OV_TYPES[t["dtype"]], t["shape"])

    lines = [
        f"name: {pbtxt_string(name)}",
        'backend: "openvino"',
        "max_batch_size: 0",
        "input [\n" + ",\n".join(tensor(t) for t in inputs) + "\n]",
        "output [\n" + ",\n".join(tensor(t) for t in outputs) + "\n]",
        "instance_group [ { count: 1, kind: KIND_CPU } ]",
        _param("PERFORMANCE_HINT", str(runtime.get("ov_hint", "latency")).upper()),
        _param("INFERENCE_NUM_THREADS", threads),
    ]
    if runtime.get("ov_streams"):
        lines.append(_param("NUM_STREAMS", int(runtime["ov_streams"])))
    if runtime.get("ov_denormals") is not None:
        lines.append(f"# measured with CPU_DENORMALS_OPTIMIZATION {bool(runtime['ov_denormals'])}; this backend "
                     "documents no parameter for it")
    if runtime.get("ov_static_shapes"):
        lines.append("# measured with a static-shape compile per input shape; this backend compiles the model once, "
                     "with the dims above")
    precision = runtime.get("ov_precision", "default")
    if precision == "bf16":
        lines.append(_param("HINT_BF16", "YES"))
    elif precision == "f32":
        lines.append("# measured with precision f32; this backend has no f32 setting (only HINT_BF16), so a CPU with "
                     "bf16 may run it in bf16 here")
    return "\n".join(lines) + "\n"
