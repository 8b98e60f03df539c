"""`optimizer export`: one stage of a run written as a deployable bundle (onnx, triton, tensorrt, openvino,
generation, genai), built in a staging folder beside --out and moved into place only when complete. A bundle holds
the model files, reference inputs and the stage's outputs on them (reference.npz, and the same in Polygraphy's
formats), and manifest.json: inputs and outputs with dtypes and shapes, precision summary, runtime options, library
versions, the hardware it was tuned on, the stage's benchmark and accuracy numbers, the tolerance verify applies,
and the sha256 of every file (deploy.manifest is its one reader; deploy.verify and deploy.bench use it).
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
from optimizer.deploy.generation import export_generation_bundle
from optimizer.deploy.manifest import load_bundle
from optimizer.deploy.openvino_bundle import export_openvino_bundle
from optimizer.deploy.shared import MANIFEST, REFERENCE, manifest_io, reference_key, run_recipe
from optimizer.deploy.staging import Interrupts, out_lock, staged
from optimizer.deploy.triton import triton_config
from optimizer.measure.best import choose_stage
from optimizer.measure.scenario_best import choose_for_scenario
from optimizer.report.run_folder import stage_artifact
from optimizer.report.schema import RunReport


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
    from passes.quantize.config import QuantizeNotes

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


def _budget(metrics: Any) -> dict[str, Any] | None:
    """The stage's verdict against the recipe's accuracy budget, as the report has it: a bundle of a stage outside
    it (exported by name) says REJECTED where its reader looks, the manifest."""
    if metrics is None or not metrics.budget:
        return None
    verdict = (f"within the accuracy budget ({metrics.budget})" if metrics.within_budget
               else f"REJECTED: outside the accuracy budget ({metrics.budget}); exported because it was named")
    return {"within": bool(metrics.within_budget), "edge": bool(metrics.budget_edge), "verdict": verdict}


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
        "accuracy_budget": _budget(metrics),
        "recipe": report.recipe.to_json(),
    }
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest["files"] = {str(p.relative_to(root)): file_sha256(p) for p in files}
    (root / MANIFEST).write_text(strict_json_dumps(manifest, indent=2))  # other tools read it: strict JSON

