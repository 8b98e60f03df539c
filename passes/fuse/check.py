"""Numeric check of a rewritten graph against its input graph, on every sample of every scenario."""

from __future__ import annotations

from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.pass_base import PassContext


def compare_graphs(before: Artifact, after: Artifact, ctx: PassContext) -> dict[str, Any]:
    """Per output: the worst cosine and max abs error of `after` against `before` (same runtime options, on the
    CPU), through the one accuracy implementation (ctx.check)."""
    check = ctx.check(before, after)
    return {name: {"cosine": a.cosine, "max_abs": a.max_abs} for name, a in check.per_output.items()}
