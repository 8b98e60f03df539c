"""Robustness corpus: every pass over the small models the onnx package ships with inputs and outputs
(onnx/backend/test/data: pytorch-converted, pytorch-operator, simple).

Each model becomes a recipe (ONNX source, its test inputs as the data file) with every applicable pass
branching from stage 0, run with on_failure: continue. A stage either matches stage 0's outputs within the
pass's tolerance, or declines (skipped, or failed with a recorded reason). What must never happen is an
exception escaping the pipeline: that is counted as a crash.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Tolerances against stage 0 (the model under ORT with optimizations off), on the model's own test inputs.
PASSES: dict[str, tuple[dict[str, Any], float]] = {
    "ort_session": ({"type": "ort_session"}, 0.9999),
    "fuse": ({"type": "fuse", "from": "source"}, 0.9999),
    "int8_dynamic": (
        {"type": "quantize", "name": "int8_dynamic", "from": "source", "config": {"mode": "int8_dynamic"}},
        0.99,
    ),
    "fp16": ({"type": "quantize", "name": "fp16", "from": "source", "config": {"mode": "fp16"}}, 0.999),
}
SUITES = ("pytorch-converted", "pytorch-operator", "simple")
DTYPES = {"int64", "int32", "float32", "float16", "bool"}


@dataclass
class CorpusResult:
    models: int = 0
    source_declined: list[str] = field(default_factory=list)
    matched: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PASSES, 0))
    declined: dict[str, list[str]] = field(default_factory=lambda: {p: [] for p in PASSES})
    mismatched: dict[str, list[str]] = field(default_factory=lambda: {p: [] for p in PASSES})
    crashed: list[str] = field(default_factory=list)


def corpus_dirs(suites: tuple[str, ...] = SUITES) -> list[Path]:
    import onnx

    root = Path(onnx.__file__).parent / "backend" / "test" / "data"
    return sorted(d for s in suites for d in (root / s).iterdir() if (d / "model.onnx").is_file())


def _inputs(model_dir: Path) -> dict[str, np.ndarray] | str:
    """The model's first test inputs by name, or why they cannot be used."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in inits]
    files = sorted((model_dir / "test_data_set_0").glob("input_*.pb"), key=lambda p: int(p.stem.split("_")[1]))
    if len(files) != len(names):
        return f"{len(files)} input files for {len(names)} inputs"
    feed = {}
    for name, f in zip(names, files, strict=True):
        tensor = onnx.TensorProto()
        try:
            tensor.ParseFromString(f.read_bytes())
            arr = numpy_helper.to_array(tensor)
        except Exception:  # sequences, maps, optionals: not tensors
            return f"input {name!r} is not a tensor"
        if str(arr.dtype) not in DTYPES:
            return f"input {name!r} has dtype {arr.dtype}, which recipes do not describe"
        feed[name] = arr
    return feed


def run_one(model_dir: Path, work: Path, result: CorpusResult) -> None:
    from optimizer.engine.pipeline import Pipeline
    from optimizer.recipe.loading import parse_recipe

    label = f"{model_dir.parent.name}/{model_dir.name}"
    feed = _inputs(model_dir)
    if isinstance(feed, str):
        result.source_declined.append(f"{label}: {feed}")
        return
    np.savez(work / "inputs.npz", **feed)
    recipe = parse_recipe(
        {
            "name": model_dir.name,
            "model": {"source": "onnx", "path": str(model_dir / "model.onnx")},
            "inputs": [{"name": n, "dtype": str(a.dtype), "shape": list(a.shape)} for n, a in feed.items()],
            "data_file": str(work / "inputs.npz"),
            "scenarios": [{"name": "data", "batch": 1, "seq": 1}],
            "target": {"threads": 1},
            "benchmark": {"warmup": 1, "rounds": 2, "iterations": 1, "memory": "inline"},  # robustness, not memory
            "accuracy": {"samples": 1},
            "on_failure": "continue",
            "passes": [spec for spec, _ in PASSES.values()],
        },
        label,
        work,
    )
    try:
        records = Pipeline(recipe, work / "run").execute()
    except Exception as e:  # the one thing the corpus exists to catch
        result.crashed.append(f"{label}: {type(e).__name__}: {e}")
        return
    source = records[0]
    if not source.ok:
        result.source_declined.append(f"{label}: {source.reason}")
        return
    for rec, (name, (_, tolerance)) in zip(records[1:], PASSES.items(), strict=True):
        if not rec.ok:
            result.declined[name].append(f"{label}: {rec.status}: {rec.reason}")
            continue
        worst = min((a["cosine"] for a in rec.metrics["accuracy"].values()), default=1.0)
        exact = all(a["max_abs"] == 0.0 for a in rec.metrics["accuracy"].values())
        if exact or worst >= tolerance:
            result.matched[name] += 1
        else:
            result.mismatched[name].append(f"{label}: cosine {worst:.5f} < {tolerance}")


def run_corpus(dirs: list[Path], progress: Any = None) -> CorpusResult:
    result = CorpusResult()
    for i, model_dir in enumerate(dirs):
        result.models += 1
        with tempfile.TemporaryDirectory() as tmp:
            run_one(model_dir, Path(tmp), result)
        if progress:
            progress(i + 1, len(dirs), model_dir.name)
    return result


def table(result: CorpusResult) -> str:
    ran = result.models - len(result.source_declined)
    lines = [
        f"models tried: {result.models}; stage 0 ran on {ran} (declined: {len(result.source_declined)}); "
        f"crashed: {len(result.crashed)}",
        "",
        "| pass | matched | declined with reason | mismatched |",
        "|---|---|---|---|",
    ]
    for name in PASSES:
        lines.append(
            f"| {name} | {result.matched[name]} | {len(result.declined[name])} | {len(result.mismatched[name])} |"
        )
    return "\n".join(lines)
