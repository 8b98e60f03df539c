"""The denormal probe: how much faster a CPU ONNX stage would run with denormal floats flushed to zero.

Arithmetic on denormal (subnormal) floats takes a slow microcode path on x86 cores. Padded inputs produce them:
the attention probabilities of masked (padded) keys come out of softmax as denormals, and every later product
with them is slow, so a padded request can run 2x slower than an unpadded one of the same shape. Nothing in a
graph says so, so the harness asks the stage itself: the same artifact with `denormal_as_zero` (a second session)
is timed interleaved with the stage's own session for a few short rounds per scenario. The ratio, stage / flushed,
is stored per scenario (`ScenarioMetrics.denormal_probe`), and the report says where flushing would pay. A CPU
that handles denormals in hardware (runtime.denormals.denormal_penalty about 1: AMD Zen 4 here) is not probed.
"""

from __future__ import annotations

from typing import Any

from optimizer.core.artifact import Artifact
from optimizer.core.metrics import Speedup
from optimizer.measure.harness import Timed, measure, warm_up_all
from optimizer.measure.stats import speedup
from optimizer.recipe.schema import BenchmarkSettings, Recipe
from optimizer.runtime.inputs import FeedSet
from optimizer.runtime.runners.base import Session

PENALTY_FLOOR = 1.5  # a CPU that multiplies denormals less than this much slower than normals is not probed
PROBE_ROUNDS = 4  # both orders twice: enough to resolve the 1.3x-2x effects the probe is for, not 5% ones


def probe_reason(artifact: Artifact, recipe: Recipe) -> str | None:
    """Why a stage is not probed (None: it is)."""
    from optimizer.runtime.denormals import caller_flush_supported, process_denormal_penalty

    if not recipe.benchmark.denormal_probe:
        return "benchmark.denormal_probe is off"
    if recipe.target.device != "cpu" or artifact.kind != "onnx" or artifact.path is None:
        return "only ONNX Runtime stages on the CPU are probed"
    if artifact.runtime.get("denormal_as_zero"):
        return "the stage flushes denormals already"
    if not caller_flush_supported():
        return "this CPU cannot flush denormals"
    penalty = process_denormal_penalty()
    if penalty < PENALTY_FLOOR:
        return f"this CPU computes on denormal floats at full speed ({penalty:.2f}x a normal multiply)"
    return None


def probe_settings(settings: BenchmarkSettings) -> BenchmarkSettings:
    """A short interleaved measurement: fixed rounds, half the recipe's calls a round, one session a side."""
    return settings.model_copy(
        update={"rounds": PROBE_ROUNDS, "iterations": max(2, settings.iterations // 2), "target_ci": 0.0,
                "resolve_tail": False, "min_round_seconds": 0.0, "instances": 1}
    )


def probe_denormals(
    artifact: Artifact, recipe: Recipe, session: Session, feeds: FeedSet, prepared: dict[str, list[Any]]
) -> dict[str, Speedup]:
    """Per scenario, the stage's P50 over its flushed twin's (> 1: flushing would make it faster), timed
    interleaved with `session`, the stage's own warm session."""
    from optimizer.runtime.runners import runner_for

    flushed = artifact.derive(runtime={**artifact.runtime, "denormal_as_zero": True})
    settings = probe_settings(recipe.benchmark)
    out: dict[str, Speedup] = {}
    with runner_for(flushed, recipe).load() as twin:
        for sf in feeds:
            name = sf.scenario.name
            inputs = [twin.prepare(f) for f in sf.samples]
            warm_up_all(twin, inputs, settings.warmup)
            child = Timed(twin, inputs)
            stage = Timed(session, prepared[name])
            measure(child, stage, settings)
            out[name] = speedup(stage.rounds, child.rounds, settings.confidence)
    return out
