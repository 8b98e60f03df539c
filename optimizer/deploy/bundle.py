"""Deployable bundles: `optimizer export` writes one, `optimizer verify` checks one, `optimizer bench` times one.

A bundle holds the model files, reference inputs and the stage's outputs on them (reference.npz), and
manifest.json: inputs and outputs with dtypes and shapes, precision summary, runtime options, library
versions, the hardware it was tuned on, the stage's benchmark and accuracy numbers, the tolerance verify
applies, and the sha256 of every file. `triton` lays the same out as a Triton model repository.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact, file_sha256
from optimizer.core.errors import OptimizerError
from optimizer.core.jsonio import strict_json_dumps
from optimizer.core.stage import StageReport
from optimizer.deploy.generation import bench_generation, export_generation_bundle, verify_generation
from optimizer.deploy.manifest import file_problems, load_bundle, read_manifest, reference_problems
from optimizer.deploy.openvino_bundle import bench_openvino, export_openvino_bundle, verify_openvino
from optimizer.deploy.shared import (
    MANIFEST,
    REFERENCE,
    bundle_session,
    feed_for,
    manifest_io,
    output_problems,
    pbtxt_string,
    reference_feeds,
    reference_key,
    run_recipe,
)
from optimizer.deploy.staging import Interrupts, out_lock, staged
from optimizer.measure.best import choose_stage
from optimizer.measure.scenario_best import choose_for_scenario
from optimizer.report.run_folder import stage_artifact
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


def pick_stage(report: RunReport, name: str, scenario: str | None = None) -> StageReport:
    """The named stage, or "best" by the one rule (optimizer/measure/best.py): fastest within the budget by the
    chained interleaved ratios, ties within noise broken by size; with a scenario, that scenario's winner
    (measure.scenario_best)."""
    if scenario is not None:
        if name != "best":
            raise OptimizerError(f"--scenario goes with --stage best (the scenario's winner); --stage {name!r} names "
                                 "one stage already")
        return choose_for_scenario(report.stages, report.scenario_names, name, scenario)
    return choose_stage(report.stages, report.scenario_names, name)


def _precision(stage: StageReport) -> dict[str, Any]:
    """The manifest's `precision`: what the stage's own notes say ran (its pass's Notes model)."""
    from passes.nncf_int8 import NncfInt8Notes
    from passes.quantize import QuantizeNotes

    if stage.type in ("openvino", "nncf_int8"):  # what the compiled model ran, per runtime precision
        ov = NncfInt8Notes.model_validate(stage.notes)  # an openvino stage's notes are the same less FakeQuantize
        ran = ov.precision
        hint = ran.hint if ran is not None else None
        layers = ran.layers if ran is not None else {}
        int8 = ran is not None and ran.int8_layers() > 0
        return {"mode": "int8" if int8 else hint or "f32", "hint": hint, "layers": layers,
                **({"fake_quantize_nodes": ov.fake_quantize_nodes} if "fake_quantize_nodes" in stage.notes else {})}
    if stage.type == "quantize":
        q = QuantizeNotes.model_validate(stage.notes)
        return {"mode": q.mode, "int8_nodes": q.int8_nodes, "quantization_ops": q.quantization_ops}
    return {"mode": "fp32"}


def export_bundle(
    report: RunReport,
    stage_name: str,
    fmt: str,
    out: Path,
    scenario: str | None = None,
    interrupts: Interrupts | None = None,
) -> Path:
    """Write the bundle into a staging folder beside `out` and move it into place only when it is complete, so a
    failed or interrupted export leaves nothing half-written behind; one export at a time per `out`. The model is
    the one in the run folder (report.run_dir), as the run recorded it (report.run_folder). scenario: "best" means
    that scenario's winner. interrupts: the CLI's (deploy.staging.Interrupts)."""
    stage = pick_stage(report, stage_name, scenario)
    assert stage.artifact is not None  # pick_stage takes only stages with an artifact
    artifact = stage_artifact(report, stage)
    if fmt == "auto":  # the artifact's own format: an ONNX graph, an OpenVINO IR, a TensorRT engine
        fmt = {"openvino": "openvino", "trt_engine": "tensorrt"}.get(artifact.kind, "onnx")
        fmt = "genai" if artifact.genai_files else fmt
    if fmt == "tensorrt" and artifact.kind != "trt_engine":
        raise OptimizerError(
            f"--format tensorrt: stage {stage.name!r} is {artifact.kind}, not a TensorRT engine "
            "(this run has no tensorrt stage)"
        )
    if fmt == "openvino" and artifact.kind != "openvino":
        raise OptimizerError(
            f"--format openvino: stage {stage.name!r} is {artifact.kind}, not an OpenVINO IR (an openvino or "
            "nncf_int8 stage is)"
        )
    takes = {"onnx": ("onnx",), "triton": ("onnx", "openvino"), "genai": ("onnx",)}.get(fmt)
    if takes is not None and (artifact.kind not in takes or artifact.path is None):
        hint = " (--format openvino takes it)" if artifact.kind == "openvino" else ""
        raise OptimizerError(f"--stage: {stage.name!r} is a {artifact.kind} artifact; --format {fmt} takes "
                             f"{' or '.join(k.upper() if k == 'onnx' else 'OpenVINO' for k in takes)} stages{hint}")
    model_name = report.recipe.name.replace("-", "_")
    with out_lock(out), staged(out, interrupts) as staging:
        root = staging / model_name if fmt == "triton" else staging
        root.mkdir(parents=True, exist_ok=True)
        if fmt == "tensorrt":
            specific = _engine_bundle(report, stage, artifact, root)
        elif artifact.kind == "openvino":  # --format openvino, or triton with its OpenVINO backend
            specific = export_openvino_bundle(report, artifact, root, model_name if fmt == "triton" else None)
        elif artifact.generates() or fmt == "genai":
            specific = export_generation_bundle(report, stage, artifact, fmt, root)
        else:
            specific = _forward_bundle(report, artifact, fmt, root, model_name)
        _write_manifest(report, stage, artifact, fmt, model_name, root, specific)
        load_bundle(root)  # what verify and bench will read: checked before it is handed over
    return out / model_name if fmt == "triton" else out


def _forward_bundle(report: RunReport, artifact: Artifact, fmt: str, root: Path, model_name: str) -> dict[str, Any]:
    """One graph: the model, and its outputs on one input per scenario."""
    from optimizer.runtime.inputs import build_feeds
    from optimizer.runtime.runners.ort_runner import OrtRunner

    assert artifact.path is not None
    model_dir = root / "1" if fmt == "triton" else root
    model_dir.mkdir(parents=True, exist_ok=True)
    bundled = artifact.copy_to(model_dir, "model.onnx")  # its external data where the graph names it
    recipe = run_recipe(report)
    arrays: dict[str, np.ndarray] = {}
    feeds, results = [], []
    with OrtRunner(bundled, recipe).load() as session:
        for sf in build_feeds(recipe, 1, per_scenario=False):
            outputs = session.to_numpy(session.run(session.prepare(sf.timing)))
            scen = sf.scenario.name
            arrays.update({reference_key(scen, "in", k): v for k, v in sf.timing.items()})
            arrays.update(
                {reference_key(scen, "out", n): o for n, o in zip(session.output_names, outputs, strict=True)}
            )
            feeds.append({k: sf.timing[k] for k in session.input_names})
            results.append(dict(zip(session.output_names, outputs, strict=True)))
    np.savez(root / REFERENCE, **arrays)
    _polygraphy_reference(root, feeds, results)
    inputs, outputs = manifest_io(model_dir / "model.onnx")
    if fmt == "triton":
        (root / "config.pbtxt").write_text(triton_config(model_name, inputs, outputs, report, artifact.runtime))
    return {
        "model": str((model_dir / "model.onnx").relative_to(root)),
        "inputs": inputs,
        "outputs": outputs,
        "tolerance": {"min_cosine": 0.9999, "max_abs_relative": 1e-3},
    }


POLYGRAPHY_INPUTS, POLYGRAPHY_OUTPUTS = "polygraphy_inputs.json", "polygraphy_outputs.json"


def _polygraphy_reference(root: Path, feeds: list[dict[str, np.ndarray]], outputs: list[dict[str, np.ndarray]]) -> None:
    """The reference in Polygraphy's own formats (a list of feed dicts; RunResults), so a bundle can be checked
    without this tool: `polygraphy run model.onnx --onnxrt --load-inputs polygraphy_inputs.json
    --load-outputs polygraphy_outputs.json` (or `--trt` with an engine). Checking only: timing stays ours."""
    from polygraphy.comparator import RunResults
    from polygraphy.json import save_json

    from optimizer.core.quiet import silence_polygraphy

    silence_polygraphy()  # no "[I] Saving ..." line per file in our output
    with _torch_unavailable():
        save_json(feeds, str(root / POLYGRAPHY_INPUTS), description="optimizer bundle reference inputs")
        results = RunResults()
        results.add(outputs, runner_name="optimizer-reference")
        results.save(str(root / POLYGRAPHY_OUTPUTS))


@contextmanager
def _torch_unavailable() -> Iterator[None]:
    """Polygraphy asks, of every array it stores, whether it is a torch tensor, by importing torch (its lazy
    module's is_importable): seconds of an import export does not need, and a Ctrl-C landing inside torch's import
    crashed the process. Our arrays are numpy's: while polygraphy writes them, torch reads as not importable (a
    None in sys.modules makes `import torch` raise ImportError) unless this process has it loaded already."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


def _engine_bundle(report: RunReport, stage: StageReport, artifact: Artifact, root: Path) -> dict[str, Any]:
    """A TensorRT engine (model.plan, tied to its GPU and TensorRT version), its engine.json, and as reference
    the first input of each scenario with stage 0's outputs on it: an engine cannot be run without its GPU, so
    the expected outputs are the reference the stage was judged against, and the tolerance is what it scored."""
    from optimizer.runtime.inputs import build_feeds

    assert artifact.path is not None
    shutil.copyfile(artifact.path, root / "model.plan")
    meta_file = artifact.path.parent / "engine.json"
    if meta_file.is_file():
        shutil.copyfile(meta_file, root / "engine.json")
    recipe = run_recipe(report)
    source = report.stages[0]
    names = (source.artifact.output_names if source.artifact is not None else None) or []
    ref_path = Path(report.run_dir) / (source.folder or "") / "reference.npz"
    if not ref_path.is_file():
        raise OptimizerError(f"--format tensorrt: {ref_path} (stage 0's outputs, the reference) is missing")
    arrays: dict[str, np.ndarray] = {}
    feeds, results = [], []
    with np.load(ref_path) as ref:
        for sf in build_feeds(recipe, 1, per_scenario=False):
            scen = sf.scenario.name
            arrays.update({reference_key(scen, "in", k): v for k, v in sf.timing.items()})
            for j, name in enumerate(names):
                arrays[reference_key(scen, "out", name)] = ref[f"{scen}|0|{j}"]
            feeds.append(dict(sf.timing))
            results.append({name: ref[f"{scen}|0|{j}"] for j, name in enumerate(names)})
    np.savez(root / REFERENCE, **arrays)
    _polygraphy_reference(root, feeds, results)
    accuracy = stage.metrics.accuracy if stage.metrics is not None else {}
    worst = min((a.cosine for a in accuracy.values()), default=1.0)
    feed = build_feeds(recipe, 1, per_scenario=False)
    first = next(iter(feed)).timing
    return {
        "model": "model.plan",
        "inputs": [{"name": k, "dtype": str(v.dtype), "shape": list(v.shape)} for k, v in first.items()],
        "outputs": [{"name": n} for n in names],
        "engine": artifact.engine or {},
        # Outputs are stage 0's: the engine must come as close as it did when it was measured.
        "tolerance": {"min_cosine": round(max(worst - 1e-3, 0.0), 6), "against": "stage 0", "max_abs_relative": None},
    }


def _write_manifest(
    report: RunReport,
    stage: StageReport,
    artifact: Artifact,
    fmt: str,
    model_name: str,
    root: Path,
    specific: dict[str, Any],
) -> None:
    metrics = stage.metrics
    manifest = {
        "format": fmt,
        "model_name": model_name,
        "stage": stage.name,
        "stage_type": stage.type,
        "precision": _precision(stage),
        **specific,
        "runtime": {
            "onnxruntime_session": artifact.runtime,
            "providers": ["CPUExecutionProvider"],
            "threads": int(artifact.runtime.get("intra_op_threads") or report.settings.threads),
        } if artifact.kind != "openvino" else {
            "openvino": artifact.runtime,  # compile options (runtime.ov_engine), on the CPU
            "device": "CPU",
            "threads": int(artifact.runtime.get("intra_op_threads") or report.settings.threads),
        },
        "library_versions": report.environment.packages,
        "tuned_on": {
            "cpu": report.environment.cpu,
            "device": report.settings.device,
            "platform": report.environment.platform,
        },
        "benchmark": {
            s: m.to_json(exclude={"samples_ms"}) for s, m in (metrics.scenarios if metrics is not None else {}).items()
        },
        "accuracy_vs_stage_0": ({n: a.to_json() for n, a in metrics.accuracy.items()} if metrics is not None else None),
        "recipe": report.recipe.to_json(),
    }
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest["files"] = {str(p.relative_to(root)): file_sha256(p) for p in files}
    (root / MANIFEST).write_text(strict_json_dumps(manifest, indent=2))  # other tools read it: strict JSON


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
        dims = t["shape"][1:] if batched else t["shape"]
        dims_txt = ", ".join(str(d) if isinstance(d, int) else "-1" for d in dims)
        kind = t.get("onnx_type") or t["dtype"].upper()
        if kind not in TRITON_TYPES:
            raise OptimizerError(f"--format triton: tensor {t['name']!r} has type {kind}, which Triton has no type for")
        name = pbtxt_string(t["name"])
        return f"  {{\n    name: {name}\n    data_type: {TRITON_TYPES[kind]}\n    dims: [ {dims_txt} ]\n  }}"

    level = TRITON_GRAPH_LEVEL[runtime.get("graph_optimization_level", "disable_all")]
    gpu = report.settings.device == "cuda"

    def param(key: str, value: object) -> str:
        return f"parameters {{ key: {pbtxt_string(key)} value: {{ string_value: {pbtxt_string(str(value))} }} }}"

    lines = [
        f"name: {pbtxt_string(name)}",
        'platform: "onnxruntime_onnx"',
        f"max_batch_size: {max_batch}",
        "input [\n" + ",\n".join(tensor(t) for t in inputs) + "\n]",
        "output [\n" + ",\n".join(tensor(t) for t in outputs) + "\n]",
        f"instance_group [ {{ count: 1, kind: {'KIND_GPU' if gpu else 'KIND_CPU'} }} ]",
        # Served as it was measured: the benchmarked threads and execution mode, not the backend's defaults.
        param("intra_op_thread_count", int(runtime.get("intra_op_threads") or report.settings.threads)),
        param("inter_op_thread_count", int(runtime.get("inter_op_threads", 1))),
        param("execution_mode", 1 if runtime.get("execution_mode") == "parallel" else 0),
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
    if max_batch > 1:  # from the run's batch sweep when it has one (see optimizer/sweep.py)
        lines.append(f"dynamic_batching {{ preferred_batch_size: [ {preferred} ] max_queue_delay_microseconds: 100 }}")
    return "\n".join(lines) + "\n"


def verify_bundle(root: Path) -> list[str]:
    """Problems found (empty when the bundle is good): the manifest's shape and bounds, checksums, the reference,
    then outputs on the reference inputs (deploy.manifest is the one reader of what a bundle holds)."""
    try:
        manifest = read_manifest(root)
    except OptimizerError as e:
        return [str(e)]
    problems = file_problems(root, manifest) or reference_problems(root, manifest)
    if problems:
        return problems
    try:
        return _run_checks(root, manifest)
    except OptimizerError as e:  # a reference that does not fit the model, a model ONNX Runtime cannot load
        return [str(e)]


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


def bench_bundle(root: Path, rounds: int, iterations: int) -> dict[str, Any]:
    """The bundle timed by the same harness as compile (alone: there is no parent), per reference scenario, holding
    the host's bench slot as compile's timings do (a compile's timing and this one never overlap)."""
    from optimizer.measure.bench_slot import bench_slot
    from optimizer.measure.harness import time_calls, warm_up
    from optimizer.measure.stats import latency_stats

    manifest = load_bundle(root)  # checked: files inside it and as exported, options and threads in bounds
    if manifest.get("workload") == "generation":
        with bench_slot(f"bench {root.name}"):  # its loading too: deploy.generation loads and times in one go
            return bench_generation(root, manifest, rounds, iterations)
    if "openvino" in (manifest.get("runtime") or {}):
        with bench_slot(f"bench {root.name}"):
            return bench_openvino(root, manifest, rounds, iterations)
    session = bundle_session(root, manifest)

    class Bare:
        def run(self, prepared: Any) -> Any:
            return session.run(None, prepared)

    out = {}
    with np.load(root / REFERENCE) as ref, bench_slot(f"bench {root.name}"):
        for scen, feed in reference_feeds(ref).items():
            feed = feed_for(feed, [i.name for i in session.get_inputs()], scen)
            warm_up(Bare(), feed, 5)  # type: ignore[arg-type]
            samples = [x for _ in range(rounds) for x in time_calls(Bare(), feed, iterations)]  # type: ignore[arg-type]
            out[scen] = {
                "latency": latency_stats(samples).to_json(),
                "recorded_p50_ms": manifest["benchmark"].get(scen, {}).get("latency", {}).get("p50_ms"),
            }
    return out
