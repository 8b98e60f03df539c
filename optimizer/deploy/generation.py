"""Bundles of generation stages: the prefill and decode graphs, and the greedy loop's reference on them.

A decoder is not one call, so its reference is a whole generation per scenario: the prompt, the tokens this
stage generated greedily, and the logits of every step. `verify` reruns the loop with ONNX Runtime and requires
the same tokens and logits within the manifest's tolerance; `bench` times whole generations (TTFT, TPOT, task
time). Triton's ONNX Runtime backend runs one graph per request, not a loop over two, so `--format triton`
declines generation stages (serving them takes Triton's Python backend or a generation server).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.artifact import Artifact
from optimizer.core.errors import OptimizerError
from optimizer.core.stage import StageReport
from optimizer.deploy.shared import (
    GENERATION_TOLERANCE,
    REFERENCE,
    bundle_session,
    manifest_io,
    write_generation_reference,
)
from optimizer.report.schema import RunReport


def _generator(root: Path, manifest: dict[str, Any]) -> Any:
    from optimizer.deploy.genai_bundle import genai_generator, is_genai
    from optimizer.runtime.generation import OrtGenerator

    if is_genai(manifest):  # one graph in GenAI's layout (deploy.genai_bundle)
        return genai_generator(root, manifest)

    prefill, decode = (bundle_session(root, manifest, manifest["graphs"][part]) for part in ("prefill", "decode"))
    return OrtGenerator(prefill, decode, int(manifest["cache"]["layers"]))


def export_generation_bundle(
    report: RunReport, stage: StageReport, artifact: Artifact, fmt: str, root: Path
) -> dict[str, Any]:
    """Fill `root` (new, empty) with the graphs and the reference; returns the manifest (files not yet hashed)."""
    from optimizer.deploy.genai_bundle import export_genai_bundle
    from optimizer.runtime.generation import cache_names

    if artifact.genai_files and fmt in ("onnx", "genai"):  # GenAI's folder: ONNX, served by GenAI's runtime too
        return export_genai_bundle(report, artifact, root)
    if fmt == "genai":
        raise OptimizerError(
            f"--format genai: stage {stage.name!r} is not in ONNX Runtime GenAI's layout (a genai_build stage is); "
            "its prefill and decode graphs export with --format onnx"
        )
    if fmt != "onnx":
        raise OptimizerError(
            f"--format {fmt}: stage {stage.name!r} is a generation stage (a loop over a prefill and a decode "
            "graph); Triton's ONNX Runtime backend and a TensorRT engine run one graph per call. Use --format onnx"
        )
    for f in artifact.files():
        shutil.copyfile(f, root / f.name)
    decode = artifact.decode_path()
    assert artifact.path is not None and decode is not None
    layers = artifact.decoder_layers()
    manifest: dict[str, Any] = {
        "workload": "generation",
        "graphs": {"prefill": artifact.path.name, "decode": decode.name},
        "cache": {
            "layers": layers,
            "pairs": [{"past": p, "present": q} for p, q in cache_names(layers)],
            "layout": "[batch, heads, positions, head_dim]; decode returns present one position longer",
        },
        "loop": "greedy: prefill(prompt) -> logits, cache; then decode(token, mask, cache) per new token",
        "io": {
            part: dict(zip(("inputs", "outputs"), manifest_io(root / name), strict=True))
            for part, name in (("prefill", artifact.path.name), ("decode", decode.name))
        },  # fmt: skip
        "tolerance": dict(GENERATION_TOLERANCE),
    }
    runtime = {"onnxruntime_session": artifact.runtime, "threads": report.settings.threads}
    write_generation_reference(report, _generator(root, {**manifest, "runtime": runtime}), root)
    return manifest


def verify_generation(root: Path, manifest: dict[str, Any]) -> list[str]:
    """Rerun the loop on every reference prompt: same tokens, logits within the tolerance, or say where not."""
    from optimizer.deploy.genai_bundle import genai_runtime_problems, is_genai
    from optimizer.measure.accuracy import generation_agreement as agreement
    from optimizer.runtime.generation import Generation

    tol = manifest["tolerance"]
    gen = _generator(root, manifest)
    problems = []
    with np.load(root / REFERENCE) as ref:
        scenarios = sorted({k.split("/")[0] for k in ref.files})
        if is_genai(manifest):  # served by GenAI's own runtime as well: it must give the same tokens
            problems += genai_runtime_problems(root, ref, scenarios)
        for scen in scenarios:
            tokens = ref[f"{scen}/tokens"]
            expected = Generation(tokens, list(ref[f"{scen}/logits"]))
            a = agreement(expected, gen.generate(ref[f"{scen}/prompt"], tokens.shape[1]))
            if a["token_agreement"] < tol["min_token_agreement"]:
                problems.append(
                    f"generation on {scen}: token agreement {a['token_agreement']:.3f} (first difference at token "
                    f"{a['first_disagreement']}) below {tol['min_token_agreement']}"
                )
            if a["logits_cosine_before_divergence"] < tol["min_logits_cosine"]:
                problems.append(
                    f"generation on {scen}: logits cosine {a['logits_cosine_before_divergence']:.6f} below "
                    f"{tol['min_logits_cosine']}"
                )
    return problems


def bench_generation(root: Path, manifest: dict[str, Any], rounds: int, iterations: int) -> dict[str, Any]:
    """Whole generations on each reference prompt: task time, TTFT and TPOT, beside the compile-time P50."""
    from optimizer.measure.stats import latency_stats

    gen = _generator(root, manifest)
    out = {}
    with np.load(root / REFERENCE) as ref:
        for scen in sorted({k.split("/")[0] for k in ref.files}):
            prompt, new = ref[f"{scen}/prompt"], ref[f"{scen}/tokens"].shape[1]
            gen.generate(prompt, new, keep_logits=False)  # warm-up
            runs = [gen.generate(prompt, new, keep_logits=False) for _ in range(rounds * iterations)]
            recorded = manifest["benchmark"].get(scen, {})
            out[scen] = {
                "latency": latency_stats([g.e2e_ms for g in runs]).to_json(),
                "ttft": latency_stats([g.ttft_ms for g in runs]).to_json(),
                "tpot": latency_stats([t for g in runs for t in g.tpot_ms] or [0.0]).to_json(),
                "recorded_p50_ms": recorded.get("latency", {}).get("p50_ms"),
            }
    return out
