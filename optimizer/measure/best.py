"""The one rule for "best", used by `export --stage best`, the batch sweep, `select` and the report.

Eligible: a stage that ran (or was cached), is within the accuracy budget, has a deployable artifact (not the
PyTorch source) and was measured in every scenario through a chain of interleaved ratios back to stage 0.
Fastest: the highest speedup against stage 0, as the geometric mean over scenarios of the chained interleaved
ratios (never raw P50s: stages are timed in different sessions and a raw P50 carries its session's drift).
Ties: candidates whose speed is within noise of the fastest's are tied. Among them, a stage slower than stage 0
beyond noise is dropped when a tied stage is not, and a stage at the accuracy budget's edge (its figure's interval
straddles the line: measure.accuracy) when a tied stage is resolved within it; then the fastest wins unless
another is materially smaller on disk (at least 10% and at least 1 MiB fewer bytes: a few KB between two tiny
graphs, or a size measured as equal to a rounding, must not outweigh the measured speed), and then the smallest of
those does.

Two stages are compared through their common ancestor: only the links after it differ, so a branch is judged on
its own interleaved measurements. Each link's 95% interval is read as a normal interval in log space and the
links are independent sessions, so their variances add.

It reads stages as core.stage.StageReport, so the report, the bundles and the engine's batch sweep all choose
through it without any of them reaching above its layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from optimizer.core.errors import OptimizerError
from optimizer.core.stage import StageReport

Z95 = 1.96


@dataclass(frozen=True)
class Comparison:
    ratio: float  # > 1: the first stage is faster
    low: float
    high: float

    @property
    def tie(self) -> bool:
        return self.low <= 1.0 <= self.high


def _by_name(stages: Sequence[StageReport]) -> dict[str, StageReport]:
    return {s.name: s for s in stages}


def lineage(stages: Sequence[StageReport], name: str) -> list[str]:
    """The stage and the stages it was measured against, back to stage 0: [name, ..., source]."""
    by = _by_name(stages)
    out: list[str] = []
    cur: str | None = name
    while cur is not None and cur not in out:
        out.append(cur)
        st = by[cur]
        if st.index == 0 or not st.parent:
            break
        cur = by[st.parent].measured_against
    return out


def _link(stage: StageReport, scenario: str) -> tuple[float, float] | None:
    """(log ratio, log sigma) of a stage against the stage it was timed with, or None when not measured."""
    sm = stage.scenario(scenario)
    vs = sm.vs_parent if sm is not None else None
    if vs is None or not vs.ratio:
        return None
    lo, hi = max(vs.low, 1e-12), max(vs.high, 1e-12)
    return math.log(vs.ratio), (math.log(hi) - math.log(lo)) / (2 * Z95)


def _segment(by: dict[str, StageReport], path: list[str], scenario: str) -> tuple[float, float] | None:
    mu, var = 0.0, 0.0
    for name in path:
        link = _link(by[name], scenario)
        if link is None:
            return None
        mu, var = mu + link[0], var + link[1] ** 2
    return mu, var


def compare(stages: Sequence[StageReport], scenarios: Sequence[str], a: str, b: str) -> Comparison | None:
    """Speed of a over b (geometric mean over the scenarios) with its 95% interval, through their common ancestor;
    None when either has no measured chain in some scenario."""
    by = _by_name(stages)
    pa, pb = lineage(stages, a), lineage(stages, b)
    common = next((x for x in pa if x in pb), None)
    if common is None or not scenarios:
        return None
    seg_a, seg_b = pa[: pa.index(common)], pb[: pb.index(common)]
    mu, var = 0.0, 0.0
    for scen in scenarios:
        sa, sb = _segment(by, seg_a, scen), _segment(by, seg_b, scen)
        if sa is None or sb is None:
            return None
        mu, var = mu + sa[0] - sb[0], var + sa[1] + sb[1]
    k = len(scenarios)
    mu, sigma = mu / k, math.sqrt(var) / k
    return Comparison(math.exp(mu), math.exp(mu - Z95 * sigma), math.exp(mu + Z95 * sigma))


def eligibility(stages: Sequence[StageReport], scenarios: Sequence[str], stage: StageReport) -> str | None:
    """Why a stage cannot be best, or None."""
    if not stage.ok:
        return stage.status
    m = stage.metrics
    if m is None:
        return "not measured"
    if not m.within_budget:
        return "REJECTED (outside the accuracy budget)"
    if stage.artifact is None or stage.artifact.kind == "torch":
        return "no deployable artifact (the PyTorch source)"
    if compare(stages, scenarios, stage.name, stages[0].name) is None:
        return "no chain of interleaved ratios to stage 0 in every scenario"
    return None


MATERIAL_SHARE = 0.10  # a tied stage must be this much smaller than the fastest to win on size ...
MATERIAL_BYTES = 2**20  # ... and by at least this many bytes


def _size(stage: StageReport) -> float:
    m = stage.metrics
    return float(m.size_bytes or math.inf) if m is not None else math.inf


def materially_smaller(a: StageReport, b: StageReport) -> bool:
    """Whether a's artifact is smaller than b's by enough to choose it over an equally fast b."""
    sa, sb = _size(a), _size(b)
    return sa < math.inf and (sb == math.inf or (sb - sa >= MATERIAL_BYTES and sa <= sb * (1 - MATERIAL_SHARE)))


def format_size(n_bytes: float) -> str:
    """Bytes as MB, or as KB with enough digits when under 1 MB."""
    if n_bytes == math.inf:
        return "?"
    return f"{n_bytes / 2**20:.1f} MB" if n_bytes >= 2**20 else f"{n_bytes / 2**10:.1f} KB"


def _at_edge(stage: StageReport) -> bool:
    return stage.metrics is not None and stage.metrics.budget_edge


def best_stage(
    stages: Sequence[StageReport], scenarios: Sequence[str], include_source: bool = False
) -> tuple[StageReport | None, str]:
    """The best stage by the rule above, and the sentence that says why. include_source: stage 0 competes too
    (the reference, within budget by definition): "keep PyTorch" is an answer for one scenario (scenario_best)."""
    source = stages[0].name
    eligible = [s for s in stages if eligibility(stages, scenarios, s) is None]
    if include_source and stages[0].ok and stages[0].metrics is not None and stages[0] not in eligible:
        eligible.insert(0, stages[0])
    if not eligible:
        return None, "no stage is within the accuracy budget with a deployable artifact measured in every scenario"
    speed = {s.name: compare(stages, scenarios, s.name, source) for s in eligible}
    fastest = max(eligible, key=lambda s: speed[s.name].ratio)  # type: ignore[union-attr]
    ties = [s for s in eligible if s is fastest or compare(stages, scenarios, s.name, fastest.name).tie]  # type: ignore[union-attr]
    not_slower = [s for s in ties if speed[s.name].high >= 1.0]  # type: ignore[union-attr]
    ties = not_slower or ties  # a stage slower than stage 0 beyond noise loses to one that is not
    at_edge = [s for s in ties if _at_edge(s)]
    resolved = [s for s in ties if not _at_edge(s)]
    ties = resolved or ties  # a stage not known to be within the budget loses to an equally fast one that is
    fastest = max(ties, key=lambda s: speed[s.name].ratio)  # type: ignore[union-attr]
    smaller = [s for s in ties if materially_smaller(s, fastest)]
    chosen = min(smaller, key=_size) if smaller else fastest
    c = speed[chosen.name]
    assert c is not None
    why = (
        f"`{chosen.name}`: {c.ratio:.2f}x the speed of stage 0 ({c.low:.2f}-{c.high:.2f}, chained interleaved "
        f"ratios, geometric mean over {len(scenarios)} scenario(s)), within the accuracy budget"
    )
    if chosen is not fastest:
        f = speed[fastest.name]
        assert f is not None
        why += (
            f"; `{fastest.name}` ({f.ratio:.2f}x) is within noise of it, and `{chosen.name}` is smaller "
            f"({format_size(_size(chosen))} vs {format_size(_size(fastest))})"
        )
    elif len(ties) > 1:
        others = ", ".join(f"`{s.name}`" for s in ties if s is not chosen)
        why += f"; also within noise: {others}, none smaller by 10% and 1 MB"
    if _at_edge(chosen):
        why += "; its accuracy is at the budget's edge, not resolved (no stage resolved within it is as fast)"
    elif at_edge and resolved:
        why += (f"; preferred to {', '.join(f'`{s.name}`' for s in at_edge)}, as fast within noise but at the "
                "accuracy budget's edge, not resolved")
    faster_rejected = [
        s.name
        for s in stages
        if s.ok
        and s.metrics is not None
        and not s.metrics.within_budget
        and (cmp := compare(stages, scenarios, s.name, chosen.name)) is not None
        and cmp.ratio > 1
    ]
    if faster_rejected:
        why += f"; faster but REJECTED by the budget: {', '.join(f'`{n}`' for n in faster_rejected)}"
    return chosen, why


def choose_stage(stages: Sequence[StageReport], scenarios: Sequence[str], name: str) -> StageReport:
    """The stage `export --stage` and the batch sweep take: the named one (it must have an artifact), or "best" by
    the rule above. Refusals are one OptimizerError that names the option."""
    if name != "best":
        stage = next((s for s in stages if s.name == name), None)
        if stage is None:
            raise OptimizerError(f"--stage: no stage {name!r} (stages: {', '.join(s.name for s in stages)})")
        if not stage.ok or stage.artifact is None:
            raise OptimizerError(f"--stage: stage {name!r} has no artifact to export ({stage.status})")
        return stage
    chosen, why = best_stage(stages, scenarios)
    if chosen is None:
        raise OptimizerError(f"--stage best: {why}")
    return chosen
