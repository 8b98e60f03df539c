"""OpenVINO bundles (`export --format openvino`): the IR (model.xml + model.bin), its outputs on one input per
scenario as the reference, and the compile options it was measured with; `verify` and `bench` compile it with
those options on this machine's CPU."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError
from optimizer.deploy.manifest import OvRuntime, validation_line
from optimizer.deploy.shared import (
    REFERENCE,
    output_problems,
    reference_feeds,
    reference_key,
    run_recipe,
)
from optimizer.deploy.triton import triton_openvino_config
from optimizer.report.schema import RunReport

MODEL = "model.xml"


def _port(port: Any) -> dict[str, Any]:
    shape = [str(d) if d.is_dynamic else d.get_length() for d in port.get_partial_shape()]
    return {"name": port.get_any_name(), "dtype": port.get_element_type().get_type_name(), "shape": shape}


def export_openvino_bundle(
    report: RunReport, artifact: Artifact, root: Path, triton_name: str | None = None
) -> dict[str, Any]:
    """Copy the IR into the bundle and record its outputs on the first input of every scenario. triton_name: lay
    it out as a Triton model repository for the OpenVINO backend (config.pbtxt, the IR under 1/)."""
    from optimizer.runtime.inputs import build_feeds
    from optimizer.runtime.runners.ov_runner import OvRunner

    model_dir = root / "1" if triton_name else root
    model_dir.mkdir(parents=True, exist_ok=True)
    for f in artifact.files():
        shutil.copyfile(f, model_dir / (MODEL if f == artifact.path else f.name))
    recipe = run_recipe(report)
    arrays: dict[str, np.ndarray] = {}
    feeds = build_feeds(recipe, 1, per_scenario=False)
    with OvRunner(artifact.derive(path=model_dir / MODEL), recipe).load() as session:
        for sf in feeds:
            scen = sf.scenario.name
            outputs = session.to_numpy(session.run(session.prepare(sf.timing)))
            fed = session.feed_names(sf.timing)  # type: ignore[attr-defined]
            arrays.update({reference_key(scen, "in", k): sf.timing[k] for k in fed})
            named = zip(session.output_names, outputs, strict=True)
            arrays.update({reference_key(scen, "out", n): o for n, o in named})
        compiled = session.compiled  # type: ignore[attr-defined]
        names = session.feed_names(next(iter(feeds)).timing)  # type: ignore[attr-defined]
        inputs = [{**_port(p), "name": n} for p, n in zip(compiled.inputs, names, strict=True)]
        outputs_io = [_port(p) for p in compiled.outputs]
    np.savez(root / REFERENCE, **arrays)
    if triton_name:
        threads = int(artifact.runtime.get("intra_op_threads") or report.settings.threads)
        (root / "config.pbtxt").write_text(triton_openvino_config(triton_name, inputs, outputs_io, artifact.runtime,
                                                                  threads))
    return {
        "model": str((model_dir / MODEL).relative_to(root)),
        "inputs": inputs,
        "outputs": outputs_io,
        # the same IR and options on the same kind of CPU: rounding differences only
        "tolerance": {"min_cosine": 0.9999, "max_abs_relative": 1e-2},
    }


def runtime_of(manifest: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The manifest's compile options and threads, checked by the bundle reader's model (deploy.manifest.OvRuntime:
    allowed values, threads bounded by this machine); one line naming the field when they are not usable."""
    runtime = manifest.get("runtime")
    if not isinstance(runtime, dict) or not isinstance(runtime.get("openvino"), dict):
        raise OptimizerError("manifest.json: runtime.openvino: a mapping of compile options is required")
    try:
        checked = OvRuntime.model_validate(runtime)
    except ValidationError as e:
        raise OptimizerError(validation_line(e, "manifest.json", ("runtime",))) from None
    return checked.openvino.model_dump(exclude_none=True), checked.threads


def _session(root: Path, manifest: dict[str, Any]) -> Any:
    from optimizer.runtime.ov_engine import compile_model, openvino_reason
    from optimizer.runtime.runners.ov_runner import OvSession

    reason = openvino_reason()
    if reason is not None:
        raise OptimizerError(f"{root}: {reason}")
    runtime, threads = runtime_of(manifest)
    return OvSession(compile_model(root / manifest["model"], runtime, threads), runtime, threads,
                     model_path=root / manifest["model"])


def verify_openvino(root: Path, manifest: dict[str, Any]) -> list[str]:
    """The IR's outputs on the reference inputs within the recorded tolerance."""
    session = _session(root, manifest)
    if not (root / REFERENCE).is_file():
        return [f"{REFERENCE}: missing (the reference outputs verify compares with)"]
    problems = []
    with np.load(root / REFERENCE) as ref:
        for scen, feed in reference_feeds(ref).items():
            got = session.to_numpy(session.run(session.prepare(feed)))
            problems += output_problems(ref, scen, session.output_names, got, manifest["tolerance"])
    return problems


def bench_openvino(root: Path, manifest: dict[str, Any], rounds: int, iterations: int) -> dict[str, Any]:
    """The IR timed per reference scenario by the harness's own loop, as compile timed it (alone)."""
    from optimizer.measure.harness import time_calls, warm_up
    from optimizer.measure.stats import latency_stats

    session = _session(root, manifest)
    out = {}
    with np.load(root / REFERENCE) as ref:
        for scen, feed in reference_feeds(ref).items():
            prepared = session.prepare(feed)
            warm_up(session, prepared, 5)
            samples = [x for _ in range(rounds) for x in time_calls(session, prepared, iterations)]
            out[scen] = {
                "latency": latency_stats(samples).to_json(),
                "recorded_p50_ms": ((manifest.get("benchmark") or {}).get(scen) or {}).get("latency", {}).get("p50_ms"),
            }
    return out
