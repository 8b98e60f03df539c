"""What every kind of bundle uses (export.py, verify.py and bench.py for one graph or an engine, generation.py
for a prefill/decode pair): the bundle's file names, the I/O of an ONNX graph, a CPU session on a bundled graph,
and the run's recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from optimizer.core.errors import OptimizerError
from optimizer.deploy.manifest import MANIFEST, REFERENCE, reference_key, split_key
from optimizer.recipe.schema import Recipe
from optimizer.report.schema import RunReport

__all__ = ["MANIFEST", "REFERENCE", "reference_key", "split_key"]
# A generation bundle's reference comes from this very bundle on the same runtime, so a rerun elsewhere differs in
# rounding only (cosine ~1 - 1e-12); an INT8 variant of the same model is ~1 - 1e-4 and must not pass for it.
GENERATION_TOLERANCE = {"min_token_agreement": 1.0, "min_logits_cosine": 0.999999}


def onnx_dtype(elem_type: int) -> tuple[str, str]:
    """(numpy dtype name or the ONNX name when numpy has none, ONNX TensorProto type name), from onnx's tables."""
    from onnx import TensorProto, helper

    onnx_name = TensorProto.DataType.Name(elem_type)
    try:
        return str(helper.tensor_dtype_to_np_dtype(elem_type)), onnx_name
    except (KeyError, ValueError, TypeError):
        return onnx_name.lower(), onnx_name


def manifest_io(model_path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The graph's inputs (initializers left out) and outputs: name, dtype, ONNX type, shape (dim names kept)."""
    from optimizer.runtime import onnx_io

    model = onnx_io.load(model_path, with_weights=False)
    inits = {t.name for t in model.graph.initializer}

    def describe(v: Any) -> dict[str, Any]:
        t = v.type.tensor_type
        dims = [d.dim_param or (d.dim_value if d.HasField("dim_value") else "?") for d in t.shape.dim]
        dtype, onnx_type = onnx_dtype(t.elem_type)
        return {"name": v.name, "dtype": dtype, "onnx_type": onnx_type, "shape": dims}

    return [describe(v) for v in model.graph.input if v.name not in inits], [describe(v) for v in model.graph.output]


def bundle_session(root: Path, manifest: dict[str, Any], model: str | None = None) -> Any:
    """A CPU session on one of the bundle's graphs (default: its model) with the runtime options it records."""
    from optimizer.runtime.sessions import ort_session

    path = root / (model or manifest["model"])  # checked inside the bundle, threads bounded: manifest.read_manifest
    return ort_session(path, manifest["runtime"]["onnxruntime_session"], int(manifest["runtime"]["threads"]), "cpu")


def reference_feeds(ref: Any) -> dict[str, dict[str, Any]]:
    """Scenario -> its reference inputs, from a bundle's reference.npz (keys `<scenario>/in/<input>`, the input's
    name whole even where it holds '/': manifest.split_key)."""
    feeds: dict[str, dict[str, Any]] = {}
    for key in ref.files:
        scenario, part, name = split_key(key)
        feeds.setdefault(scenario, {})
        if part == "in":
            feeds[scenario][name] = ref[key]
    return dict(sorted(feeds.items()))


def feed_for(feed: dict[str, Any], names: list[str], scenario: str) -> dict[str, Any]:
    """The inputs a model takes, from a scenario's reference inputs; one line naming the one missing."""
    missing = [n for n in names if n not in feed]
    if missing:
        raise OptimizerError(f"{REFERENCE}: scenario {scenario!r} has no input {missing[0]!r} (the model takes "
                             f"{names})")
    return {n: feed[n] for n in names}


def output_problems(ref: Any, scen: str, names: list[str], got: list[Any], tol: dict[str, Any]) -> list[str]:
    """A bundle's outputs on one reference scenario against the recorded ones, within the manifest's tolerance
    (cosine, and max abs relative to the reference's largest value); NaN/inf references are said, not judged."""
    import numpy as np

    from optimizer.measure.accuracy import AccuracyMeter

    missing = [n for n in names if reference_key(scen, "out", n) not in ref.files]
    if missing:
        return [f"{REFERENCE}: scenario {scen!r} has no output {missing[0]!r} (the model gives {names})"]
    expected = [ref[reference_key(scen, "out", n)] for n in names]
    bad = [n for n, e in zip(names, expected, strict=True) if e.dtype.kind == "f" and not np.isfinite(e).all()]
    if bad:
        return [f"reference outputs {bad} on {scen} contain NaN/inf: nothing to verify against"]
    meter = AccuracyMeter(names)
    meter.add(expected, got)
    problems = []
    for n, acc in meter.per_output.items():
        scale = float(np.max(np.abs(ref[reference_key(scen, "out", n)]))) or 1.0
        if acc.cosine < tol["min_cosine"] or acc.max_abs > tol["max_abs_relative"] * scale:
            problems.append(f"output {n!r} on {scen}: cosine {acc.cosine:.6f}, max abs {acc.max_abs:.3g} "
                            f"outside the tolerance {tol}")
    return problems


def run_recipe(report: RunReport) -> Recipe:
    """The recipe the run read, from its report (relative paths resolve where the recipe was)."""
    from optimizer.recipe.loading import parse_recipe

    return parse_recipe(report.recipe.to_json(), "report.json", Path(report.recipe_dir or report.run_dir))


def write_generation_reference(report: RunReport, gen: Any, root: Path) -> None:
    """A generation bundle's reference.npz: per scenario, one prompt, the tokens `gen` generates greedily from it
    and every step's logits (`<scenario>/prompt`, `/tokens`, `/logits`)."""
    import numpy as np

    from optimizer.runtime.inputs import build_feeds

    arrays: dict[str, Any] = {}
    for sf in build_feeds(run_recipe(report), 1, per_scenario=False):
        prompt, new = sf.timing["input_ids"], sf.scenario.new_tokens
        g = gen.generate(prompt, new)
        arrays[f"{sf.scenario.name}/prompt"] = prompt
        arrays[f"{sf.scenario.name}/tokens"] = g.tokens
        arrays[f"{sf.scenario.name}/logits"] = np.stack(g.step_logits)
    np.savez(root / REFERENCE, **arrays)
