"""Deployable bundles: `optimizer export` writes one, `optimizer verify` checks one, `optimizer bench` times one.

A bundle holds the model files, reference inputs and the stage's outputs on them (reference.npz), and
manifest.json: inputs and outputs with dtypes and shapes, precision summary, runtime options, library
versions, the hardware it was tuned on, the stage's benchmark and accuracy numbers, the tolerance verify
applies, and the sha256 of every file. `triton` lays the same out as a Triton model repository.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.artifact import Artifact, file_sha256
from optimizer.errors import OptimizerError

MANIFEST = "manifest.json"
REFERENCE = "reference.npz"
ONNX_TYPES = {1: "float32", 10: "float16", 7: "int64", 6: "int32", 9: "bool", 11: "float64", 3: "int8", 2: "uint8"}
TRITON_TYPES = {
    "float32": "TYPE_FP32",
    "float16": "TYPE_FP16",
    "int64": "TYPE_INT64",
    "int32": "TYPE_INT32",
    "bool": "TYPE_BOOL",
    "float64": "TYPE_FP64",
    "int8": "TYPE_INT8",
    "uint8": "TYPE_UINT8",
}


def pick_stage(report: dict[str, Any], name: str) -> dict[str, Any]:
    """The named stage, or "best" by the one rule (optimizer/best.py): fastest within the budget by the chained
    interleaved ratios, ties within noise broken by size."""
    stages = [s for s in report["stages"] if s["status"] in ("ran", "cached") and s.get("artifact")]
    if name != "best":
        stage = next((s for s in report["stages"] if s["name"] == name), None)
        if stage is None:
            raise OptimizerError(
                f"--stage: no stage {name!r} (stages: {', '.join(s['name'] for s in report['stages'])})"
            )
        if stage not in stages:
            raise OptimizerError(f"--stage: stage {name!r} has no artifact to export ({stage['status']})")
        return stage
    from optimizer.best import best_stage

    chosen, why = best_stage(report)
    if chosen is None:
        raise OptimizerError(f"--stage best: {why}")
    return chosen


def _io(model_path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from optimizer import onnx_io

    model = onnx_io.load(model_path, with_weights=False)
    inits = {t.name for t in model.graph.initializer}

    def describe(v: Any) -> dict[str, Any]:
        t = v.type.tensor_type
        dims = [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in t.shape.dim]
        return {"name": v.name, "dtype": ONNX_TYPES.get(t.elem_type, str(t.elem_type)), "shape": dims}

    return [describe(v) for v in model.graph.input if v.name not in inits], [describe(v) for v in model.graph.output]


def _precision(stage: dict[str, Any]) -> dict[str, Any]:
    notes = stage.get("notes") or {}
    if stage["type"] == "quantize":
        return {
            "mode": notes.get("mode"),
            "int8_nodes": notes.get("int8_nodes"),
            "quantization_ops": notes.get("quantization_ops"),
        }
    return {"mode": "fp32"}


def export_bundle(report: dict[str, Any], stage_name: str, fmt: str, out: Path) -> Path:
    """Write the bundle into a staging folder beside `out` and move it into place only when it is complete, so a
    failed export leaves nothing half-written behind."""
    stage = pick_stage(report, stage_name)
    artifact = Artifact.from_json(stage["artifact"])
    run_dir = Path(report["run_dir"])
    if artifact.path is not None and not artifact.path.is_file():  # the run folder moved, or a relative path
        artifact = Artifact(
            artifact.kind, run_dir / stage["folder"] / artifact.path.name, artifact.runtime, artifact.meta
        )
    if fmt == "tensorrt" and artifact.kind != "trt_engine":
        raise OptimizerError(
            f"--format tensorrt: stage {stage['name']!r} is {artifact.kind}, not a TensorRT engine "
            "(this run has no tensorrt stage)"
        )
    if artifact.kind != "onnx" or artifact.path is None:
        raise OptimizerError(f"--stage: {stage['name']!r} is a {artifact.kind} artifact; export takes ONNX stages")
    if out.exists() and any(out.iterdir()):
        raise OptimizerError(f"--out: {out} exists and is not empty")
    staging = out.parent / f".{out.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        model_name = report["recipe"]["name"].replace("-", "_")
        root = staging / model_name if fmt == "triton" else staging
        root.mkdir(parents=True, exist_ok=True)
        if artifact.meta.get("decode"):
            from optimizer.bundle_gen import export_generation_bundle

            specific = export_generation_bundle(report, stage, artifact, fmt, root)
        else:
            specific = _forward_bundle(report, artifact, fmt, root, model_name)
        _write_manifest(report, stage, artifact, fmt, model_name, root, specific)
        if out.exists():
            out.rmdir()  # checked empty above
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out / model_name if fmt == "triton" else out


def _forward_bundle(
    report: dict[str, Any], artifact: Artifact, fmt: str, root: Path, model_name: str
) -> dict[str, Any]:
    """One graph: the model, and its outputs on one input per scenario."""
    from optimizer.inputs import build_feeds
    from optimizer.recipe import parse_recipe
    from optimizer.runners.ort_runner import OrtRunner

    assert artifact.path is not None
    model_dir = root / "1" if fmt == "triton" else root
    model_dir.mkdir(parents=True, exist_ok=True)
    for f in artifact.files():
        shutil.copyfile(f, model_dir / ("model.onnx" if f == artifact.path else f.name))
    recipe = parse_recipe(report["recipe"], "report.json", Path(report.get("recipe_dir") or report["run_dir"]))
    arrays: dict[str, np.ndarray] = {}
    bundled = Artifact("onnx", model_dir / "model.onnx", artifact.runtime, artifact.meta)
    with OrtRunner(bundled, recipe).load() as session:
        for sf in build_feeds(recipe, 1, per_scenario=False):
            outputs = session.to_numpy(session.run(session.prepare(sf.timing)))
            arrays.update({f"{sf.scenario.name}/in/{k}": v for k, v in sf.timing.items()})
            arrays.update(
                {f"{sf.scenario.name}/out/{n}": o for n, o in zip(session.output_names, outputs, strict=True)}
            )
    np.savez(root / REFERENCE, **arrays)
    inputs, outputs = _io(model_dir / "model.onnx")
    if fmt == "triton":
        (root / "config.pbtxt").write_text(triton_config(model_name, inputs, outputs, report, artifact.runtime))
    return {
        "model": str((model_dir / "model.onnx").relative_to(root)),
        "inputs": inputs,
        "outputs": outputs,
        "tolerance": {"min_cosine": 0.9999, "max_abs_relative": 1e-3},
    }


def _write_manifest(
    report: dict[str, Any],
    stage: dict[str, Any],
    artifact: Artifact,
    fmt: str,
    model_name: str,
    root: Path,
    specific: dict[str, Any],
) -> None:
    metrics = stage.get("metrics") or {}
    manifest = {
        "format": fmt,
        "model_name": model_name,
        "stage": stage["name"],
        "stage_type": stage["type"],
        "precision": _precision(stage),
        **specific,
        "runtime": {
            "onnxruntime_session": artifact.runtime,
            "providers": ["CPUExecutionProvider"],
            "threads": report["settings"]["threads"],
        },
        "library_versions": report["environment"]["packages"],
        "tuned_on": {
            "cpu": report["environment"]["cpu"],
            "device": report["settings"]["device"],
            "platform": report["environment"]["platform"],
        },
        "benchmark": {
            s: {k: v for k, v in m.items() if k != "samples_ms"} for s, m in (metrics.get("scenarios") or {}).items()
        },
        "accuracy_vs_stage_0": metrics.get("accuracy"),
        "recipe": report["recipe"],
    }
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest["files"] = {str(p.relative_to(root)): file_sha256(p) for p in files}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))


def triton_config(
    name: str,
    inputs: list[dict[str, Any]],
    outputs: list[dict[str, Any]],
    report: dict[str, Any],
    runtime: dict[str, Any],
) -> str:
    """config.pbtxt for Triton's ONNX Runtime backend; batch dim first when every input and output has one."""
    batched = all(t["shape"] and t["shape"][0] == "batch" for t in inputs + outputs)
    sweep = report.get("batch_sweep") or {}
    max_batch = (sweep.get("max_batch") or max(s["batch"] for s in report["scenarios"])) if batched else 0
    preferred = sweep.get("preferred_batch") or max_batch

    def tensor(t: dict[str, Any]) -> str:
        dims = t["shape"][1:] if batched else t["shape"]
        dims_txt = ", ".join(str(d) if isinstance(d, int) else "-1" for d in dims)
        return (
            f'  {{\n    name: "{t["name"]}"\n    data_type: {TRITON_TYPES.get(t["dtype"], "TYPE_FP32")}\n'
            f"    dims: [ {dims_txt} ]\n  }}"
        )

    level = {"disable_all": -1, "basic": 1, "extended": 1, "all": 1}.get(runtime.get("graph_optimization_level", "all"))
    lines = [
        f'name: "{name}"',
        'platform: "onnxruntime_onnx"',
        f"max_batch_size: {max_batch}",
        "input [\n" + ",\n".join(tensor(t) for t in inputs) + "\n]",
        "output [\n" + ",\n".join(tensor(t) for t in outputs) + "\n]",
        f"optimization {{ graph {{ level: {level} }} }}",
        "instance_group [ { count: 1, kind: KIND_CPU } ]",
    ]
    if max_batch > 1:  # from the run's batch sweep when it has one (see optimizer/sweep.py)
        lines.append(f"dynamic_batching {{ preferred_batch_size: [ {preferred} ] max_queue_delay_microseconds: 100 }}")
    return "\n".join(lines) + "\n"


def verify_bundle(root: Path) -> list[str]:
    """Problems found (empty when the bundle is good): checksums, then outputs on the reference inputs."""
    from optimizer.accuracy import AccuracyMeter

    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        return [f"{manifest_path}: missing"]
    manifest = json.loads(manifest_path.read_text())
    problems = []
    for rel, digest in manifest["files"].items():
        path = root / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif file_sha256(path) != digest:
            problems.append(f"{rel}: sha256 differs from the manifest (the file was changed)")
    if problems:
        return problems
    if manifest.get("workload") == "generation":
        from optimizer.bundle_gen import verify_generation

        return verify_generation(root, manifest)
    session = _session(root, manifest)
    names = [o.name for o in session.get_outputs()]
    tol = manifest["tolerance"]
    with np.load(root / REFERENCE) as ref:
        scenarios = sorted({k.split("/")[0] for k in ref.files})
        for scen in scenarios:
            feed = {k.split("/")[2]: ref[k] for k in ref.files if k.startswith(f"{scen}/in/")}
            got = session.run(names, {i.name: feed[i.name] for i in session.get_inputs()})
            meter = AccuracyMeter(names)
            expected = [ref[f"{scen}/out/{n}"] for n in names]
            meter.add(expected, got)
            for n, acc in meter.per_output.items():
                scale = float(np.max(np.abs(ref[f"{scen}/out/{n}"]))) or 1.0
                if acc.cosine < tol["min_cosine"] or acc.max_abs > tol["max_abs_relative"] * scale:
                    problems.append(
                        f"output {n!r} on {scen}: cosine {acc.cosine:.6f}, max abs {acc.max_abs:.3g} "
                        f"outside the tolerance {tol}"
                    )
    return problems


def _session(root: Path, manifest: dict[str, Any], model: str | None = None) -> Any:
    """A CPU session on one of the bundle's graphs (default: its model) with the runtime options it records."""
    import onnxruntime as ort

    from optimizer.runners.ort_runner import session_options

    path = root / (model or manifest["model"])
    so = session_options(manifest["runtime"]["onnxruntime_session"], int(manifest["runtime"]["threads"]))
    try:
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise OptimizerError(f"{path}: onnxruntime cannot load it: {e}") from e


def bench_bundle(root: Path, rounds: int, iterations: int) -> dict[str, Any]:
    """The bundle timed by the same harness as compile (alone: there is no parent), per reference scenario."""
    from optimizer.benchmark import time_calls, warm_up
    from optimizer.stats import LatencyStats

    manifest = json.loads((root / MANIFEST).read_text())
    if manifest.get("workload") == "generation":
        from optimizer.bundle_gen import bench_generation

        return bench_generation(root, manifest, rounds, iterations)
    session = _session(root, manifest)

    class Bare:
        def run(self, prepared: Any) -> Any:
            return session.run(None, prepared)

    out = {}
    with np.load(root / REFERENCE) as ref:
        for scen in sorted({k.split("/")[0] for k in ref.files}):
            feed = {k.split("/")[2]: ref[k] for k in ref.files if k.startswith(f"{scen}/in/")}
            feed = {i.name: feed[i.name] for i in session.get_inputs()}
            warm_up(Bare(), feed, 5)  # type: ignore[arg-type]
            samples = [x for _ in range(rounds) for x in time_calls(Bare(), feed, iterations)]  # type: ignore[arg-type]
            out[scen] = {
                "latency": LatencyStats.of(samples).to_json(),
                "recorded_p50_ms": manifest["benchmark"].get(scen, {}).get("latency", {}).get("p50_ms"),
            }
    return out
