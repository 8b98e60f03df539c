"""Best per scenario: the answer a user with one workload needs, and what the overall best costs in each.

Performance is scenario-specific: a stage that is 4x stage 0 on short inputs can be slower than PyTorch on long
ones. So, beside the overall best (measure.best, geometric mean over scenarios), each scenario gets its own
winner by the same rule (chained interleaved ratios, ties within noise, size), with stage 0 as a candidate: when
every deployable stage is slower than PyTorch beyond noise, "keep PyTorch" is the answer. Then:
  - `losses`: the scenarios where the overall best is slower, beyond noise, than that scenario's winner (stage 0
    included), with the ratio and its interval;
  - `advice`: when the winners differ and the overall best loses somewhere, what a deployment can do: route by
    sequence length (the crossover lies between two measured lengths of one batch size), or serve the one stage
    whose worst shortfall against the scenario winners is smallest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from optimizer.core.errors import OptimizerError
from optimizer.core.metrics import ScenarioLoss, ScenarioWinner
from optimizer.core.stage import StageReport
from optimizer.measure.best import best_stage, choose_stage, compare, eligibility


def scenario_winners(stages: Sequence[StageReport], scenarios: Sequence[str]) -> dict[str, ScenarioWinner]:
    """Per scenario, the winner among the deployable stages within budget and stage 0 (skipped when none)."""
    out: dict[str, ScenarioWinner] = {}
    source = stages[0].name
    for scen in scenarios:
        chosen, why = best_stage(stages, [scen], include_source=True)
        if chosen is None:
            continue
        c = compare(stages, [scen], chosen.name, source)
        if c is None:
            continue
        keep = chosen.name == source
        if keep:
            why = _keep_source_why(stages, scen)
        out[scen] = ScenarioWinner(stage=chosen.name, ratio=c.ratio, low=c.low, high=c.high, keep_source=keep, why=why)
    return out


def source_label(stages: Sequence[StageReport]) -> str:
    """Stage 0 as a user knows it: their PyTorch model, or the model file they brought (an ONNX source)."""
    art = stages[0].artifact
    return "PyTorch (stage 0)" if art is None or art.kind == "torch" else "the original model (stage 0)"


def _keep_source_why(stages: Sequence[StageReport], scenario: str) -> str:
    """Why stage 0 wins a scenario: the fastest other stage within the budget there, and how much slower it is."""
    source = stages[0].name
    others = [(c, s) for s in stages[1:] if eligibility(stages, [scenario], s) is None
              and (c := compare(stages, [scenario], s.name, source)) is not None]
    keep = f"keep {source_label(stages)}"
    if not others:
        return f"{keep}: no other stage is within the budget with a measured chain here"
    c, fastest = max(others, key=lambda cs: cs[0].ratio)
    return (f"{keep}: the fastest other stage within the budget, `{fastest.name}`, is {c.ratio:.2f}x its speed "
            f"({c.low:.2f}-{c.high:.2f})")


def losses(stages: Sequence[StageReport], best: str, winners: dict[str, ScenarioWinner]) -> list[ScenarioLoss]:
    """The scenarios where `best` is slower than the scenario's winner beyond noise."""
    out = []
    for scen, w in winners.items():
        if w.stage == best:
            continue
        c = compare(stages, [scen], best, w.stage)
        if c is not None and c.high < 1.0:
            out.append(ScenarioLoss(scenario=scen, winner=w.stage, ratio=c.ratio, low=c.low, high=c.high,
                                    keep_source=w.keep_source, winner_label=_name(stages, w)))
    return out


def _crossovers(
    stages: Sequence[StageReport], scenarios: Sequence[Any], winners: dict[str, ScenarioWinner]
) -> list[str]:
    """Where the winner changes between two fixed sequence lengths of one batch size: a routing rule."""
    out = []
    fixed = [s for s in scenarios if s.name in winners and s.padding != "longest"]
    for batch in sorted({s.batch for s in fixed}):
        row = sorted((s for s in fixed if s.batch == batch), key=lambda s: s.seq)
        for a, b in zip(row, row[1:], strict=False):
            wa, wb = winners[a.name], winners[b.name]
            if wa.stage != wb.stage:
                out.append(
                    f"at batch {batch}, route requests of up to {a.seq} tokens to {_name(stages, wa)} and of {b.seq} "
                    f"or more to {_name(stages, wb)} (the crossover lies between {a.seq} and {b.seq}: not measured "
                    "in between)"
                )
    return out


def _name(stages: Sequence[StageReport], w: ScenarioWinner) -> str:
    return source_label(stages) if w.keep_source else f"`{w.stage}`"


def robust_stage(
    stages: Sequence[StageReport], winners: dict[str, ScenarioWinner]
) -> tuple[str, float, str] | None:
    """The deployable stage within budget whose worst ratio to the scenario winners is highest: (name, that
    ratio, the scenario where it is reached)."""
    scenarios = list(winners)
    best: tuple[str, float, str] | None = None
    for st in stages:
        if eligibility(stages, scenarios, st) is not None:
            continue
        worst: tuple[float, str] | None = None
        for scen, w in winners.items():
            c = compare(stages, [scen], st.name, w.stage)
            if c is None:
                worst = None
                break
            if worst is None or c.ratio < worst[0]:
                worst = (c.ratio, scen)
        if worst is not None and (best is None or worst[0] > best[1]):
            best = (st.name, worst[0], worst[1])
    return best


def advice(
    stages: Sequence[StageReport],
    scenarios: Sequence[Any],
    winners: dict[str, ScenarioWinner],
    lost: list[ScenarioLoss],
) -> str | None:
    """What a deployment can do when the scenario winners differ and the overall best loses somewhere beyond noise
    (`lost`); None otherwise: winners that differ within noise are no reason to route."""
    if not lost or len({w.stage for w in winners.values()}) < 2:
        return None
    parts = _crossovers(stages, scenarios, winners)
    robust = robust_stage(stages, winners)
    if robust is not None:
        name, ratio, scen = robust
        parts.append(f"one stage for every scenario: `{name}` keeps at least {ratio:.2f}x the speed of each "
                     f"scenario's winner (worst on {scen})")
    return "; or ".join(parts) if parts else None


def choose_for_scenario(
    stages: Sequence[StageReport], scenarios: Sequence[str], name: str, scenario: str
) -> StageReport:
    """`export --stage NAME --scenario S`: the named stage, or with "best" that scenario's winner; refused, with the
    reason, when the winner is stage 0 (nothing deployable is faster than PyTorch there)."""
    if scenario not in scenarios:
        raise OptimizerError(f"--scenario: no scenario {scenario!r} in this run (scenarios: {', '.join(scenarios)})")
    if name != "best":
        return choose_stage(stages, scenarios, name)
    winner = scenario_winners(stages, [scenario]).get(scenario)
    if winner is not None and winner.keep_source:
        art = stages[0].artifact
        if art is None or art.kind == "torch":  # nothing to export: the answer is the user's PyTorch model
            raise OptimizerError(f"--scenario {scenario}: {winner.why}; export another stage with --stage NAME if "
                                 "you want it")
        return choose_stage(stages, [scenario], stages[0].name)  # the model file the user brought
    return choose_stage(stages, [scenario], "best")
