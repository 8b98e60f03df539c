"""Numeric check of a rewritten graph against its input graph, on every sample of every scenario."""

from __future__ import annotations

from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.pass_base import PassContext
from optimizer.measure.accuracy import AccuracyMeter, mask_of
from optimizer.runtime.runners.ort_runner import OrtRunner


def compare_graphs(before: Artifact, after: Artifact, ctx: PassContext) -> dict[str, Any]:
    """Per output: the worst cosine and max abs error of `after` against `before` (same runtime options)."""
    with (
        OrtRunner(before, ctx.recipe, device="cpu").load() as ref,
        OrtRunner(after, ctx.recipe, device="cpu").load() as new,
    ):
        meter = AccuracyMeter(ref.output_names)
        for sf in ctx.feeds:
            for feed in sf.samples:
                expected = ref.to_numpy(ref.run(ref.prepare(feed)))
                meter.add(expected, new.to_numpy(new.run(new.prepare(feed))), mask_of(feed))
    return {name: {"cosine": a.cosine, "max_abs": a.max_abs} for name, a in meter.per_output.items()}
