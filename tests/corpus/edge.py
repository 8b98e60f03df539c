"""Adversarial cases of issue 28, class 9 (a verdict at the budget's edge); see tests/corpus/adversarial.py."""

from __future__ import annotations

import copy
import json
import math

import numpy as np

from .adversarial import Shared

KIND = "R3.9 verdicts at the budget's edge"


def _spread(distance: float, n: int = 40) -> list[float]:
    """n cosines whose distances 1 - c spread like a log-normal's quantiles (sd 0.45 in log space)."""
    from scipy import stats

    z = stats.norm.ppf((np.arange(n) + 0.5) / n)
    return list(1.0 - np.exp(math.log(distance) + 0.45 * z))


def add_cases(r: Shared) -> None:
    from optimizer.measure.accuracy import budget_verdict
    from optimizer.measure.best import best_stage
    from optimizer.measure.stats import low_quantile_bound
    from optimizer.recipe.schema import AccuracyBudget
    from optimizer.report.schema import parse_report

    r.work.mkdir(parents=True, exist_ok=True)
    budget = AccuracyBudget(metric="pooled_cosine", min=0.99)

    def judged(cosines: list[float]) -> tuple[bool, bool]:
        p, low, high = low_quantile_bound(cosines) or (0.0, 1.0, 1.0)
        accuracy = {"y": {"pooled_cosine": min(cosines), "pooled_cosine_bound": [low, high, p]}}
        verdict = budget_verdict(accuracy, budget)
        return verdict.within, verdict.edge

    r.out.add(KIND, "worst of 40 is 0.001 above the line", lambda: judged(_spread(0.0034)) == (True, True)
              or f"judged {judged(_spread(0.0034))}, not (within, at the edge)")
    r.out.add(KIND, "well inside the budget", lambda: judged(_spread(0.0005)) == (True, False)
              or f"judged {judged(_spread(0.0005))}")

    def best_prefers_resolved() -> bool | str:
        report = json.loads((r.run / "report.json").read_text())
        stages = report["stages"]
        first, _ = best_stage(parse_report(report, "edge.json").stages, [s["name"] for s in report["scenarios"]])
        if first is None:
            return "the corpus run has no best stage"
        edge = next(s for s in stages if s["name"] == first.name)
        twin = copy.deepcopy(edge)  # the same stage twice: as fast within noise by construction
        twin["name"], twin["index"] = f"{edge['name']}_twin", len(stages)
        edge["metrics"]["budget_edge"] = True
        typed = parse_report({**report, "stages": [*stages, twin]}, "edge.json")
        chosen, why = best_stage(typed.stages, typed.scenario_names)
        return True if chosen is not None and chosen.name != first.name else f"chose {first.name} at the edge: {why}"

    r.out.add(KIND, "best among ties with one at the edge", best_prefers_resolved)
