"""`optimizer verify`: a bundle's problems, one line each (none when it is good): the manifest's shape and bounds,
checksums and the reference (deploy.manifest), then the model's outputs on the reference inputs within the
manifest's tolerance, run by what the bundle was written for (ONNX Runtime, TensorRT, OpenVINO, the generation
loop); a TensorRT engine is left unchecked, with the reason, where TensorRT or a GPU is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError
from optimizer.deploy.generation import verify_generation
from optimizer.deploy.manifest import MANIFEST, file_problems, read_manifest, reference_problems
from optimizer.deploy.openvino_bundle import verify_openvino
from optimizer.deploy.shared import REFERENCE, bundle_session, feed_for, output_problems, reference_feeds, reference_key


def verify_bundle(root: Path) -> list[str]:
    """Problems found (empty when the bundle is good): the manifest's shape and bounds, checksums, the reference,
    then outputs on the reference inputs (deploy.manifest is the one reader of what a bundle holds)."""
    try:
        manifest = read_manifest(root)
    except OptimizerError as e:
        return [str(e)]
    problems = file_problems(root, manifest) or claim_problems(root, manifest) or reference_problems(root, manifest)
    if problems:
        return problems
    try:
        return _run_checks(root, manifest)
    except OptimizerError as e:  # a reference that does not fit the model, a model ONNX Runtime cannot load
        return [str(e)]


# What an INT8/INT4 graph holds that an FP32 one does not (ONNX Runtime's quantized forms and weight-only MatMul).
QUANT_OPS = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger",
             "QLinearMatMul", "QLinearConv", "QLinearAdd", "QLinearMul", "MatMulNBits", "DynamicQuantizeMatMul",
             "QAttention", "QGemm", "QOrderedMatMul", "MatMulIntegerToFloat"}
_LOW = {2, 3, 21, 22}  # UINT8, INT8, UINT4, INT4
_HALF = {10, 16}  # FLOAT16, BFLOAT16


def claim_problems(root: Path, manifest: dict[str, Any]) -> list[str]:
    """Each claim of the manifest the model itself can confirm, checked against it: every input and output it
    lists (name, dtype, ONNX type, shape) and its precision (an int8 claim needs quantized ops or weights, fp16
    half-precision tensors, fp32 neither). One line per claim the model contradicts, naming manifest.json and the
    field. Graphs other than one ONNX model (generation, TensorRT, OpenVINO) are checked by running them."""
    model_file = manifest.get("model")
    if manifest.get("workload") == "generation" or not str(model_file or "").endswith(".onnx"):
        return []
    from optimizer.deploy.shared import manifest_io
    from optimizer.runtime import onnx_io

    where = f"{MANIFEST}: "
    problems = []
    try:
        actual_in, actual_out = manifest_io(root / model_file)
    except OptimizerError as e:
        return [str(e)]
    for part, claimed, actual in (("inputs", manifest.get("inputs") or [], actual_in),
                                  ("outputs", manifest.get("outputs") or [], actual_out)):
        have = {t["name"]: t for t in actual}
        for t in claimed:
            got = have.get(t["name"])
            if got is None:
                problems.append(f"{where}{part}.{t['name']}: the model has no such {part[:-1]} (it has "
                                f"{', '.join(have) or 'none'})")
                continue
            problems += [f"{where}{part}.{t['name']}: {key} {t[key]!r}, but the model's is {got[key]!r}"
                         for key in ("dtype", "onnx_type", "shape") if key in t and t[key] != got[key]]
        unlisted = [n for n in have if n not in {t["name"] for t in claimed}]
        if claimed and unlisted:
            problems.append(f"{where}{part}: the model's {unlisted[0]!r} is not listed")
    mode = str((manifest.get("precision") or {}).get("mode") or "")
    if mode:
        graph = onnx_io.load(root / model_file, with_weights=False).graph
        types = {t.data_type for t in graph.initializer} | {
            v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
        quantized = bool(types & _LOW) or any(n.op_type in QUANT_OPS for n in graph.node)
        half = bool(types & _HALF) or any(a.name == "to" and a.i in _HALF for n in graph.node for a in n.attribute)
        expect = {"int8_dynamic": quantized, "int8_static": quantized, "int8": quantized, "weight_only": quantized,
                  "fp16": half, "hybrid": quantized or half, "fp32": not (quantized or half),
                  "f32": not (quantized or half)}
        if not expect.get(mode, True):
            found = "quantized ops" if quantized else "half-precision tensors" if half else "FP32 only"
            problems.append(f"{where}precision.mode: {mode!r}, but the model holds {found}")
    return problems


def _run_checks(root: Path, manifest: dict[str, Any]) -> list[str]:
    if manifest.get("workload") == "generation":
        return verify_generation(root, manifest)
    if manifest["format"] == "tensorrt":
        return _verify_engine(root, manifest)
    if "openvino" in (manifest.get("runtime") or {}):  # --format openvino, or triton's OpenVINO backend
        return verify_openvino(root, manifest)
    session = bundle_session(root, manifest)
    names = [o.name for o in session.get_outputs()]
    problems = []
    with np.load(root / REFERENCE) as ref:
        for scen, feed in reference_feeds(ref).items():
            got = session.run(names, feed_for(feed, [i.name for i in session.get_inputs()], scen))
            problems += output_problems(ref, scen, names, got, manifest["tolerance"])
    return problems


def unchecked_reason(root: Path) -> str | None:
    """Why verify could not run a bundle's model here (a TensorRT engine without TensorRT or a GPU), or None."""
    try:
        if read_manifest(root).get("format") != "tensorrt":
            return None
    except OptimizerError:
        return None
    from optimizer.runtime.gpu import tensorrt_reason

    return tensorrt_reason()


def _verify_engine(root: Path, manifest: dict[str, Any]) -> list[str]:
    """The engine's outputs on the reference inputs against stage 0's, within the recorded cosine; skipped (and
    said by the CLI) where TensorRT or a GPU is missing."""
    if unchecked_reason(root) is not None:
        return []
    from optimizer.measure.accuracy import compare, mask_of
    from optimizer.runtime.runners.trt_runner import TrtRunner

    names = [o["name"] for o in manifest["outputs"]]
    problems = []
    artifact = Artifact("trt_engine", root / manifest["model"], {"cuda_graph": False})
    with TrtRunner(artifact, None).load() as session, np.load(root / REFERENCE) as ref:
        for scen, feed in reference_feeds(ref).items():
            got = session.to_numpy(session.run(session.prepare(feed)))
            meter = compare([ref[reference_key(scen, "out", n)] for n in names], got, names, mask_of(feed))
            if meter.worst_cosine() < manifest["tolerance"]["min_cosine"]:
                problems.append(
                    f"engine outputs on {scen}: cosine {meter.worst_cosine():.6f} below {manifest['tolerance']}"
                )
    return problems
