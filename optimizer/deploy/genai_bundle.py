"""Bundles of decoders in ONNX Runtime GenAI's layout: a folder GenAI's runtime serves as it is (`og.Model(folder)`:
model.onnx, its weights, genai_config.json, the tokenizer files), plus our manifest and reference.

The reference is a greedy generation per scenario by our loop (runtime.generation_shared) on the bundled graph.
`verify` reruns it, and where onnxruntime-genai is installed also runs GenAI's own runtime on the folder and
requires the same tokens: the bundle is proven servable by GenAI, not only by us. genai_config.json records the
threads the stage was timed with (GenAI's `intra_op_num_threads`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError
from optimizer.deploy.shared import (
    GENERATION_TOLERANCE,
    bundle_session,
    manifest_io,
    write_generation_reference,
)
from optimizer.report.schema import RunReport

LAYOUT = "genai_shared_buffer"


def is_genai(manifest: dict[str, Any]) -> bool:
    return (manifest.get("cache") or {}).get("kind") == LAYOUT


def genai_generator(root: Path, manifest: dict[str, Any]) -> Any:
    from optimizer.runtime.generation_shared import GenaiLayout, SharedBufferGenerator

    session = bundle_session(root, manifest, manifest["graphs"]["model"])
    return SharedBufferGenerator(session, GenaiLayout.read(root / manifest["graphs"]["genai_config"]))


def export_genai_bundle(report: RunReport, artifact: Artifact, root: Path) -> dict[str, Any]:
    """Fill `root` with GenAI's folder and the reference; returns the manifest (files not yet hashed)."""
    assert artifact.path is not None and artifact.genai_files
    for f in artifact.files():
        shutil.copyfile(f, root / f.name)
    config_name = artifact.genai_files[0]
    config = json.loads((root / config_name).read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options["intra_op_num_threads"] = int(artifact.runtime.get("intra_op_threads") or report.settings.threads)
    (root / config_name).write_text(json.dumps(config, indent=4))
    inputs, outputs = manifest_io(root / artifact.path.name)
    manifest: dict[str, Any] = {
        "workload": "generation",
        "graphs": {"model": artifact.path.name, "genai_config": config_name},
        "cache": {
            "kind": LAYOUT,
            "layers": artifact.decoder_layers(),
            "layout": "past_key_values.{i}.key/value [batch, kv_heads, prompt + new tokens, head_size], one buffer "
            "per tensor bound as both past input and present output (written in place)",
        },
        "loop": "greedy over one graph: prompt, then one token per call; attention_mask of the current length",
        "serve_with": "onnxruntime_genai: og.Model(this folder), og.Generator",
        "io": {"model": {"inputs": inputs, "outputs": outputs}},
        "tolerance": dict(GENERATION_TOLERANCE),
    }
    runtime = {"onnxruntime_session": artifact.runtime, "threads": report.settings.threads}
    write_generation_reference(report, genai_generator(root, {**manifest, "runtime": runtime}), root)
    return manifest


def genai_runtime_tokens(root: Path, prompt: np.ndarray, new: int) -> np.ndarray:
    """GenAI's own runtime on the bundle folder: greedy, exactly `new` tokens for each prompt row."""
    import onnxruntime_genai as og

    from optimizer.runtime.genai_runtime import genai_generate

    model = og.Model(str(root))
    rows = [genai_generate(model, row[None, :], new).tokens for row in prompt]
    return np.array(rows, np.int64)


def genai_runtime_problems(root: Path, ref: Any, scenarios: list[str]) -> list[str]:
    """Tokens from GenAI's runtime against the reference's, per scenario; [] when GenAI is not installed."""
    import importlib.util

    if importlib.util.find_spec("onnxruntime_genai") is None:
        return []
    problems = []
    for scen in scenarios:
        expected = ref[f"{scen}/tokens"]
        try:
            got = genai_runtime_tokens(root, ref[f"{scen}/prompt"], expected.shape[1])
        except Exception as e:  # GenAI raises RuntimeError with its own message
            raise OptimizerError(f"{root}: onnxruntime-genai cannot run this bundle: {str(e).splitlines()[0]}") from e
        if not np.array_equal(got, expected):
            first = int(np.argmax((got != expected).any(axis=0)))
            problems.append(f"generation on {scen}: GenAI's runtime gives other tokens (first at token {first})")
    return problems
